#include "sim/planner/pass_timeline.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <list>
#include <queue>
#include <tuple>

#include "sim/common/error.hpp"
#include "sim/lower/schedule.hpp"

namespace dtsim::planner {

namespace {

using lower::Pass;
using lower::PassKind;

// One device's link in one direction: the intervals it is busy, by start (booked mostly in
// order of time, so mostly appended).
class Link {
 public:
  // The first time from `t` at which the link is free for `seconds`.
  double first_free(double t, double seconds) const {
    auto it = std::upper_bound(busy_.begin(), busy_.end(), t,
                               [](double x, const Interval& b) { return x < b.start; });
    if (it != busy_.begin() && std::prev(it)->end > t) t = std::prev(it)->end;
    for (; it != busy_.end() && it->start < t + seconds; ++it) t = std::max(t, it->end);
    return t;
  }
  void book(double start, double seconds) {
    const Interval booked{start, start + seconds};
    auto it = std::upper_bound(busy_.begin(), busy_.end(), start,
                               [](double x, const Interval& b) { return x < b.start; });
    busy_.insert(it, booked);
  }
  // A link booked in time order, one transfer after another (the engine's reserve_link): when
  // its last transfer ends, and booking one after it. No gap is looked up, so none is kept.
  double last_end() const { return last_end_; }
  void book_after(double start, double seconds) {
    last_end_ = std::max(last_end_, start + seconds);
  }
  // Free again, its storage kept for the next timeline.
  void reset() {
    busy_.clear();
    last_end_ = 0;
  }

 private:
  struct Interval {
    double start, end;
  };
  std::vector<Interval> busy_;
  double last_end_ = 0;
};

// Stages as bits: insert, and the first one from a given stage on, in a word's steps.
class StageSet {
 public:
  explicit StageSet(int stages) : words_((static_cast<std::size_t>(stages) + 63) / 64) {}
  void insert(int s) { words_[word(s)] |= bit(s); }
  void erase(int s) { words_[word(s)] &= ~bit(s); }
  bool empty() const {
    return std::all_of(words_.begin(), words_.end(), [](std::uint64_t w) { return w == 0; });
  }
  // The first stage in the set at or after `s`, else -1.
  int from(int s) const {
    for (std::size_t w = word(s); w < words_.size(); ++w) {
      const std::uint64_t left = w == word(s) ? words_[w] & ~(bit(s) - 1) : words_[w];
      if (left != 0) return static_cast<int>(w * 64) + std::countr_zero(left);
    }
    return -1;
  }

 private:
  static std::size_t word(int s) { return static_cast<std::size_t>(s) / 64; }
  static std::uint64_t bit(int s) { return std::uint64_t{1} << (s % 64); }
  std::vector<std::uint64_t> words_;
};

// The timeline's pipeline transfers, one per chunk boundary, micro-batch and direction: when
// the sender and the receiver posted their sides (negative: not yet) and, once both have, when
// the transfer ends.
struct Transfers {
  std::vector<double> send_posted, recv_posted, end;
  // Blocking interleaved and zero-bubble exchanges (run_in_time_order): the order in which the
  // engine would meet the transfer's end on the sender's side, and on the receiver's (see
  // `release` there).
  std::vector<std::uint64_t> send_seq, recv_seq;
  // A device sends one pipeline transfer at a time and receives one at a time (the engine's
  // reserve_link): a stage that sends to both neighbours at once sends them one after the
  // other. The engine books a link in the order of the transfers' readiness. Blocking
  // interleaved and zero-bubble exchanges are met in that order (run_in_time_order) and booked
  // as the engine books them; the other schedules' sweep (1F1B and GPipe, whose receives
  // follow their sends between passes of one kind, and overlapped transfers) meets them stage
  // by stage, so each takes the first gap that holds it.
  std::vector<Link> out, in;
};

// A thread's transfers, kept from one timeline to the next: a search makes thousands of
// timelines of up to a few hundred thousand transfers, and fresh arrays of that size cost more
// in page faults than the timeline itself.
Transfers& thread_transfers() {
  thread_local Transfers transfers;
  return transfers;
}

class Timeline {
 public:
  Timeline(const plan::Plan& plan, const std::vector<ChunkPasses>& chunks,
           const std::vector<double>& hop)
      : chunks_(chunks),
        hop_(hop),
        pp_(plan.pp),
        m_(static_cast<int>(plan.micro_batches())),
        last_chunk_(static_cast<int>(chunks.size()) - 1),
        blocking_(!plan.overlap_p2p_comm),
        // The exchanges as the lowering emits them (schedule.hpp).
        holds_sends_(lower::exchanges_hold_senders(plan)),
        in_turn_when_alike_(lower::receives_after_sends_when_alike(plan)),
        in_time_order_(blocking_ && !in_turn_when_alike_),
        t_(thread_transfers()),
        pending_(plan.pp) {
    DTSIM_ASSERT(pp_ >= 1 && !chunks.empty() &&
                     chunks.size() % static_cast<std::size_t>(pp_) == 0 &&
                     hop.size() == static_cast<std::size_t>(pp_),
                 "pipeline_timeline: one set of passes per chunk, one hop per stage");
    const std::size_t keys = chunks.size() * static_cast<std::size_t>(m_) * 2;
    t_.send_posted.assign(keys, -1.0);
    t_.recv_posted.assign(keys, -1.0);
    t_.end.assign(keys, -1.0);
    if (in_time_order_) {
      t_.send_seq.assign(keys, 0);
      t_.recv_seq.assign(keys, 0);
    }
    t_.out.resize(static_cast<std::size_t>(pp_));
    t_.in.resize(static_cast<std::size_t>(pp_));
    for (auto* links : {&t_.out, &t_.in}) {
      for (Link& link : *links) link.reset();
    }
    const auto& passes = stage_passes_of(plan);
    stages_.resize(static_cast<std::size_t>(pp_));
    for (int s = 0; s < pp_; ++s)
      stages_[static_cast<std::size_t>(s)].passes = &passes[static_cast<std::size_t>(s)];
    last_backward_.assign(chunks.size(), 0.0);
  }

  // Sweeps the stages in order, 0 to pp - 1 and again, each run as far as its exchanges allow,
  // until all are done. A stage that stopped at an exchange can only go on once the other side
  // posts it, so a sweep skips the stages nothing was posted to since they stopped: the same
  // order of events as running every stage at every sweep (which the gradients, flowing from
  // the last stage to the first, make pp sweeps per round), in time linear in the passes.
  PipelineTimeline run() {
    if (in_time_order_) {
      run_in_time_order();
    } else {
      for (int s = 0; s < pp_; ++s) pending_.insert(s);
      for (int at = 0; !pending_.empty();) {
        int s = at < pp_ ? pending_.from(at) : -1;
        if (s < 0) s = pending_.from(0);
        pending_.erase(s);
        advance(s);
        at = s + 1;
      }
    }
    PipelineTimeline out;
    for (const Stage& st : stages_) {
      DTSIM_ASSERT(st.phase == Phase::Done, "pipeline_timeline: the schedule's exchanges deadlock");
      out.makespan_s = std::max(out.makespan_s, st.free);
      out.busy_s.push_back(st.busy);
      out.end_s.push_back(st.free);
    }
    out.last_backward_s = std::move(last_backward_);
    return out;
  }

 private:
  enum class Phase { Boundary, Sends, Receives, Done };
  struct Stage {
    const std::vector<Pass>* passes = nullptr;
    std::size_t next = 0;
    Phase phase = Phase::Boundary;
    double free = 0, busy = 0;
    double boundary = 0, sends_end = 0;  // the exchange before the next round
    bool in_turn = false;
    double weight_before = 0;  // the weight pass just run, its compute (else 0)
    double input_tail = 0;     // the input-gradient pass just run, its ChunkPasses::input_tail
    std::vector<std::size_t> to_send, sending, receiving;
  };

  // The round of a stage's pass i. Overlapped transfers: each pass its own round, its receive
  // posted ahead of need.
  int round_of(const Stage& st, std::size_t i) const {
    return blocking_ ? (*st.passes)[i].round : static_cast<int>(i);
  }

  std::size_t key(int k, int micro_batch, bool gradient) const {
    return (static_cast<std::size_t>(k) * static_cast<std::size_t>(m_) +
            static_cast<std::size_t>(micro_batch)) *
               2 +
           (gradient ? 1 : 0);
  }
  // The transfer into chunk k: activations from the chunk before (stage s - 1), gradients from
  // the chunk after (stage s + 1), over the hop between the two stages.
  int sender(std::size_t key) const {
    const int k = static_cast<int>(key / 2 / static_cast<std::size_t>(m_));
    return ((key % 2 == 1 ? k + 1 : k - 1) % pp_ + pp_) % pp_;
  }
  int receiver(std::size_t key) const {
    return static_cast<int>(key / 2 / static_cast<std::size_t>(m_)) % pp_;
  }
  double hop_of(std::size_t key) const {
    const int r = receiver(key);
    return hop_[static_cast<std::size_t>(key % 2 == 1 ? r : (r + pp_ - 1) % pp_)];
  }

  // The transfer's end once both sides are posted (negative before), booked on the sender's
  // and receiver's links when first known.
  double resolve(std::size_t k) {
    if (t_.end[k] >= 0) return t_.end[k];
    if (t_.send_posted[k] < 0 || t_.recv_posted[k] < 0) return -1;
    const auto out = static_cast<std::size_t>(sender(k));
    const auto in = static_cast<std::size_t>(receiver(k));
    const double ready = std::max(t_.send_posted[k], t_.recv_posted[k]);
    const double seconds = hop_of(k);
    if (seconds <= 0) return t_.end[k] = ready;
    // The first time from `ready` at which both links are free for the whole transfer.
    double start = ready;
    for (double before = -1; before != start;) {
      before = start;
      start = t_.out[out].first_free(start, seconds);
      start = t_.in[in].first_free(start, seconds);
    }
    t_.out[out].book(start, seconds);
    t_.in[in].book(start, seconds);
    return t_.end[k] = start + seconds;
  }

  // Blocking interleaved exchanges and zero-bubble's, as the engine meets them: the stages'
  // round boundaries in time order; at each, the stage posts its sends and its next round's
  // receives, and each transfer whose other side has posted is booked then, sends before
  // receives, each in its passes' order, on both links one transfer after another in that order
  // (a transfer that waits for its receiver's link holds its sender's link too; no gap is
  // filled). A stage runs its next round once its exchange's transfers are all in (zero-bubble's
  // receives alone: its sends do not hold it). Met stage by stage instead, a send would be
  // booked when its receiver's turn came, and one ready later could take a link from one ready
  // earlier: GPT-2 124M at tp 4 pp 8 zero-bubble, the last stage's activations booked before
  // its neighbour's gradients sent the other way across nodes (-4.2%).
  //
  // Boundaries at the same time (stages in lockstep, common where the stages' passes are
  // alike) are met in the engine's order of events: an event scheduled earlier first. A round
  // starts when the last of its exchange's transfers ends, so its boundary comes in the order
  // of that transfer's end (its two sides' events scheduled when it was booked, the sender's
  // first); the events of the round in between keep that order. Which of two stages posts
  // first decides which of their transfers gets a shared link first (a stage receiving from
  // both neighbours at once).
  void run_in_time_order() {
    using Boundary = std::tuple<double, std::uint64_t, int>;  // when, order of events, stage
    std::priority_queue<Boundary, std::vector<Boundary>, std::greater<>> boundaries;
    std::uint64_t events = 0;  // the engine's order of scheduling, as far as it decides ties
    for (int s = 0; s < pp_; ++s) boundaries.emplace(0.0, events++, s);
    std::vector<std::size_t> open(static_cast<std::size_t>(pp_), 0);  // transfers not booked
    // The stage's next round, from the end of its exchange's last transfer (the event met
    // last, where several end together).
    auto release = [&](int s, std::uint64_t posted) {
      Stage& st = stages_[static_cast<std::size_t>(s)];
      double start = st.boundary;
      std::uint64_t last = posted;
      const auto later = [&](std::size_t k, std::uint64_t seq) {
        if (t_.end[k] > start || (t_.end[k] == start && seq > last)) {
          start = t_.end[k];
          last = seq;
        }
      };
      if (holds_sends_) {
        for (std::size_t k : st.sending) later(k, t_.send_seq[k]);
      }
      for (std::size_t k : st.receiving) later(k, t_.recv_seq[k]);
      if (run_round(s, st, start)) boundaries.emplace(st.free, last, s);
    };
    std::vector<std::uint64_t> posted_at(static_cast<std::size_t>(pp_), 0);
    while (!boundaries.empty()) {
      const int s = std::get<2>(boundaries.top());
      boundaries.pop();
      Stage& st = stages_[static_cast<std::size_t>(s)];
      posted_at[static_cast<std::size_t>(s)] = events++;
      post_exchange(s, st);
      for (std::size_t k : st.sending) t_.send_posted[k] = st.boundary;
      for (std::size_t k : st.receiving) t_.recv_posted[k] = st.boundary;
      open[static_cast<std::size_t>(s)] =
          (holds_sends_ ? st.sending.size() : 0) + st.receiving.size();
      std::vector<int> released;
      for (const auto* keys : {&st.sending, &st.receiving}) {
        for (std::size_t k : *keys) {
          if (t_.send_posted[k] < 0 || t_.recv_posted[k] < 0 || t_.end[k] >= 0) continue;
          book_in_order(k);
          t_.send_seq[k] = events++;
          t_.recv_seq[k] = events++;
          const int other = keys == &st.sending ? receiver(k) : sender(k);
          // The sender's side first, as the engine finishes a transfer's send before its
          // receive (a sender that does not wait for its sends, zero-bubble's, counts none).
          for (const int side : keys == &st.sending ? std::array{s, other} : std::array{other, s}) {
            if (!holds_sends_ && side == sender(k)) continue;
            if (--open[static_cast<std::size_t>(side)] == 0) released.push_back(side);
          }
        }
      }
      if (open[static_cast<std::size_t>(s)] == 0 &&
          std::find(released.begin(), released.end(), s) == released.end()) {
        released.push_back(s);
      }
      for (const int r : released) release(r, posted_at[static_cast<std::size_t>(r)]);
    }
  }

  // The stage's exchange at a round boundary: the sends of the round that ended, and the
  // receives of the next.
  void post_exchange(int s, Stage& st) {
    st.boundary = st.free;
    st.sending = std::move(st.to_send);
    st.to_send.clear();
    st.receiving.clear();
    const int round = st.next < st.passes->size() ? round_of(st, st.next) : -1;
    for (std::size_t i = st.next; i < st.passes->size() && round_of(st, i) == round; ++i) {
      const Pass& pass = (*st.passes)[i];
      const int k = pass.chunk * pp_ + s;
      if (pass.kind == PassKind::Forward && k > 0) {
        st.receiving.push_back(key(k, pass.micro_batch, false));
      }
      if ((pass.kind == PassKind::Backward || pass.kind == PassKind::BackwardInput) &&
          k < last_chunk_) {
        st.receiving.push_back(key(k, pass.micro_batch, true));
      }
    }
  }

  // A transfer both sides have posted, booked now, after every transfer booked before on
  // either link.
  void book_in_order(std::size_t k) {
    const auto out = static_cast<std::size_t>(sender(k));
    const auto in = static_cast<std::size_t>(receiver(k));
    const double ready = std::max(t_.send_posted[k], t_.recv_posted[k]);
    const double seconds = hop_of(k);
    if (seconds <= 0) {
      t_.end[k] = ready;
      return;
    }
    const double start = std::max({ready, t_.out[out].last_end(), t_.in[in].last_end()});
    t_.out[out].book_after(start, seconds);
    t_.in[in].book_after(start, seconds);
    t_.end[k] = start + seconds;
  }

  // Runs stage s as far as its exchanges allow.
  void advance(int s) {
    Stage& st = stages_[static_cast<std::size_t>(s)];
    while (st.phase != Phase::Done) {
      if (st.phase == Phase::Boundary) {
        post_exchange(s, st);
        for (std::size_t k : st.sending) {
          t_.send_posted[k] = st.boundary;
          pending_.insert(receiver(k));
        }
        st.in_turn = in_turn_when_alike_ && st.next > 0 && st.next < st.passes->size() &&
                     (*st.passes)[st.next - 1].kind == (*st.passes)[st.next].kind;
        if (!st.in_turn) post_receives(st, blocking_ ? st.boundary : 0.0);
        st.phase = Phase::Sends;
      }
      if (st.phase == Phase::Sends) {
        st.sends_end = st.boundary;
        if (holds_sends_) {
          for (std::size_t k : st.sending) {
            const double end = resolve(k);
            if (end < 0) return;  // the receiver has not posted yet
            st.sends_end = std::max(st.sends_end, end);
          }
        }
        if (st.in_turn) post_receives(st, st.sends_end);
        st.phase = Phase::Receives;
      }
      // Phase::Receives: the next round starts once its inputs are in.
      double start = st.sends_end;
      for (std::size_t k : st.receiving) {
        const double end = resolve(k);
        if (end < 0) return;  // the sender has not produced it yet
        start = std::max(start, end);
      }
      if (!run_round(s, st, start)) break;
      st.phase = Phase::Boundary;
    }
  }

  void post_receives(const Stage& st, double when) {
    for (std::size_t k : st.receiving) {
      t_.recv_posted[k] = when;
      pending_.insert(sender(k));
    }
  }

  // The stage's next round from `start`, its exchange done; false (the stage done) when it has
  // none left.
  bool run_round(int s, Stage& st, double start) {
    st.free = start;
    if (st.next == st.passes->size()) {
      st.phase = Phase::Done;
      return false;
    }
    const int round = round_of(st, st.next);
    while (st.next < st.passes->size() && round_of(st, st.next) == round) {
      run(s, st, (*st.passes)[st.next]);
      ++st.next;
    }
    return true;
  }

  void run(int s, Stage& st, const Pass& pass) {
    const int k = pass.chunk * pp_ + s;
    const ChunkPasses& c = chunks_[static_cast<std::size_t>(k)];
    double length = pass.kind == PassKind::Forward          ? c.forward
                    : pass.kind == PassKind::BackwardWeight ? c.weight
                                                            : c.backward;
    if (pass.kind == PassKind::BackwardWeight) {
      const bool layered = c.all_layered || (c.last_layered && pass.micro_batch + 1 == m_);
      const double gathers = layered ? c.layered_gathers : c.gathers;
      length += std::max(0.0, gathers - std::max(st.weight_before, st.input_tail));
      st.weight_before = c.weight;
      st.input_tail = 0;
    } else {
      st.weight_before = 0;
      st.input_tail = pass.kind == PassKind::BackwardInput ? c.input_tail : 0.0;
    }
    if (pass.kind == PassKind::Backward || pass.kind == PassKind::BackwardWeight) {
      const std::size_t per_stage = chunks_.size() / static_cast<std::size_t>(pp_);
      last_backward_[static_cast<std::size_t>(s) * per_stage +
                     static_cast<std::size_t>(pass.chunk)] = st.free;
    }
    st.free += length;
    st.busy += length;
    if (pass.kind == PassKind::Forward && k < last_chunk_) {
      st.to_send.push_back(key(k + 1, pass.micro_batch, false));
    }
    if ((pass.kind == PassKind::Backward || pass.kind == PassKind::BackwardInput) && k > 0) {
      st.to_send.push_back(key(k - 1, pass.micro_batch, true));
    }
  }

  const std::vector<ChunkPasses>& chunks_;
  const std::vector<double>& hop_;
  int pp_, m_, last_chunk_;
  bool blocking_, holds_sends_, in_turn_when_alike_;
  bool in_time_order_;  // run_in_time_order
  Transfers& t_;        // the thread's (thread_transfers)
  std::vector<Stage> stages_;
  std::vector<double> last_backward_;  // PipelineTimeline::last_backward_s
  StageSet pending_;                   // stages something was posted to since they last stopped
};

}  // namespace

// (The closed form times each candidate twice, without and with its hops, and its candidates
// share passes.)
const std::vector<std::vector<lower::Pass>>& stage_passes_of(const plan::Plan& plan) {
  struct Entry {
    plan::Schedule schedule;
    int pp;
    std::int64_t micro_batches;
    int virtual_stages;
    std::vector<std::vector<lower::Pass>> passes;
  };
  constexpr std::size_t kKept = 8;
  thread_local std::list<Entry> kept;  // the most recently used first
  const std::int64_t m = plan.micro_batches();
  for (auto it = kept.begin(); it != kept.end(); ++it) {
    if (it->schedule == plan.schedule && it->pp == plan.pp && it->micro_batches == m &&
        it->virtual_stages == plan.virtual_stages) {
      kept.splice(kept.begin(), kept, it);
      return kept.front().passes;
    }
  }
  Entry entry{plan.schedule, plan.pp, m, plan.virtual_stages, {}};
  for (int s = 0; s < plan.pp; ++s) entry.passes.push_back(lower::stage_passes(plan, s));
  kept.push_front(std::move(entry));
  if (kept.size() > kKept) kept.pop_back();
  return kept.front().passes;
}

PipelineTimeline pipeline_timeline(const plan::Plan& plan, const std::vector<ChunkPasses>& chunks,
                                   const std::vector<double>& hop) {
  return Timeline(plan, chunks, hop).run();
}

}  // namespace dtsim::planner
