#include "exec/cpu/mpi_comm.hpp"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>

#include "exec/core/deadline.hpp"
#include "exec/core/timing_stats.hpp"
#include "exec/cpu/bf16_device.hpp"
#include "exec/cpu/device.hpp"

namespace dtsim::exec::cpu {

namespace {

std::string host_name() {
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  if (MPI_Get_processor_name(name, &length) != MPI_SUCCESS) return "?";
  return std::string(name, static_cast<std::size_t>(length));
}

// Ends every rank: a failed MPI call leaves the collective it belongs to unfinishable.
[[noreturn]] void fail(const char* call, int rc) {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(rc, text, &length);
  std::cerr << fmt::format("dtexec: rank {} on {}: {} failed: {}\n", rank, host_name(), call,
                           std::string(text, static_cast<std::size_t>(length)));
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

void check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) fail(call, rc);
}

int count_of(std::size_t n) {
  DTSIM_ASSERT(n <= 0x7fffffffULL, "MPI counts are int");
  return static_cast<int>(n);
}

// bf16 reductions (the CPU's bf16 emulation, bf16_device.hpp): each step widens both operands,
// adds (or takes the larger) in fp32 and rounds back to bf16, as a bf16 NCCL reduction rounds
// at each step of its ring. Created as non-commutative, so that MPI combines the members in
// rank order and every member gets the same sum.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = to_bf16(from_bf16(a[i]) + from_bf16(b[i]));
}

void bf16_max(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = to_bf16(std::max(from_bf16(a[i]), from_bf16(b[i])));
}

// Every rank's `mine`, rank by rank, on rank 0 of `comm` (the others get none), sent point to
// point with tag 0: `comm` must carry nothing else meanwhile. Checkpoint parts pass 2 GiB (12
// bytes per parameter): 64-bit lengths, and each part sent in pieces that MPI's int counts hold.
std::vector<std::string> texts_to_root(MPI_Comm comm, std::string mine) {
  int rank = 0, size = 1;
  check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  constexpr std::int64_t kPiece = std::int64_t{1} << 30;
  const auto length = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(size));
  check(MPI_Gather(&length, 1, MPI_INT64_T, lengths.data(), 1, MPI_INT64_T, 0, comm), "MPI_Gather");
  std::vector<std::string> out;
  if (rank != 0) {
    for (std::int64_t at = 0; at < length; at += kPiece) {
      check(MPI_Send(mine.data() + at, static_cast<int>(std::min(kPiece, length - at)), MPI_CHAR, 0,
                     0, comm),
            "MPI_Send");
    }
    return out;
  }
  out.push_back(std::move(mine));
  for (int r = 1; r < size; ++r) {
    std::string part(static_cast<std::size_t>(lengths[static_cast<std::size_t>(r)]), '\0');
    const auto n = static_cast<std::int64_t>(part.size());
    for (std::int64_t at = 0; at < n; at += kPiece) {
      check(MPI_Recv(part.data() + at, static_cast<int>(std::min(kPiece, n - at)), MPI_CHAR, r, 0,
                     comm, MPI_STATUS_IGNORE),
            "MPI_Recv");
    }
    out.push_back(std::move(part));
  }
  return out;
}

class MpiComm final : public Comm {
 public:
  MpiComm(const MpiSession& session, const lower::Program& program)
      : rank_(session.rank()), size_(session.size()) {
    if (program.lowering != lower::Lowering::AllRanks ||
        static_cast<int>(program.ranks.size()) != size_) {
      throw InputError(fmt::format(
          "the plan has {} ranks but mpirun started {} processes: run it with mpirun -np {}",
          program.plan.devices(), size_, program.plan.devices()));
    }
    MPI_Group world = MPI_GROUP_NULL;
    check(MPI_Comm_group(MPI_COMM_WORLD, &world), "MPI_Comm_group");
    int* tag_ub = nullptr;
    int found = 0;
    check(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found), "MPI_Comm_get_attr");
    tag_ub_ = found ? *tag_ub : 32767;
    comms_.assign(program.groups.size(), MPI_COMM_NULL);
    members_.resize(program.groups.size());
    // Every rank creates the communicators of its groups in group order: the lowest group
    // still being created has all its members at it, so creation cannot deadlock.
    for (std::size_t g = 0; g < program.groups.size(); ++g) {
      const auto& ranks = program.groups[g].ranks;
      std::vector<int> members(ranks.begin(), ranks.end());
      members_[g] = members;
      if (members.size() < 2 || std::find(members.begin(), members.end(), rank_) == members.end()) {
        continue;
      }
      MPI_Group group = MPI_GROUP_NULL;
      check(MPI_Group_incl(world, static_cast<int>(members.size()), members.data(), &group),
            "MPI_Group_incl");
      check(MPI_Comm_create_group(MPI_COMM_WORLD, group, static_cast<int>(g) % tag_ub_, &comms_[g]),
            "MPI_Comm_create_group");
      MPI_Group_free(&group);
    }
    MPI_Group_free(&world);
    // Outside the Program (checkpoint parts): a communicator of its own, so that its messages
    // never match a pipeline transfer's tag.
    check(MPI_Comm_dup(MPI_COMM_WORLD, &side_), "MPI_Comm_dup");
    check(MPI_Type_contiguous(2, MPI_BYTE, &bf16_), "MPI_Type_contiguous");
    check(MPI_Type_commit(&bf16_), "MPI_Type_commit");
    check(MPI_Op_create(bf16_sum, /*commute=*/0, &bf16_sum_), "MPI_Op_create");
    check(MPI_Op_create(bf16_max, /*commute=*/0, &bf16_max_), "MPI_Op_create");
  }

  ~MpiComm() override {
    wait_sends();
    for (auto& c : comms_) {
      if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
    }
    if (side_ != MPI_COMM_NULL) MPI_Comm_free(&side_);
    if (bf16_sum_ != MPI_OP_NULL) MPI_Op_free(&bf16_sum_);
    if (bf16_max_ != MPI_OP_NULL) MPI_Op_free(&bf16_max_);
    if (bf16_ != MPI_DATATYPE_NULL) MPI_Type_free(&bf16_);
  }

  // Open MPI (4.1, Debian 12) moves a nonblocking collective's data inside MPI calls only
  // (MPI_Test between tasks, MPI_Wait), with no progress thread: on cpu-small at tp 2, an
  // overlapped all-reduce's span held the weight-gradient GEMM beside it.
  bool progresses_while_computing() const override { return false; }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce(int group, View view, Reduce op) override {
    const Wire data = wire(view);
    MPI_Comm c = comm(group);
    if (c == MPI_COMM_NULL) return;
    check(MPI_Allreduce(MPI_IN_PLACE, data.p, data.n, data.type, reduction(view, op), c),
          "MPI_Allreduce");
  }

  void reduce_scatter(int group, View in_view, View out_view,
                      std::span<const int> counts) override {
    const Wire in = wire(in_view), out = wire(out_view, in_view.type);
    MPI_Comm c = comm(group);
    if (c == MPI_COMM_NULL) {
      copy(out, in);
      return;
    }
    expect_shapes("reduce-scatter", in_view, out_view, counts, member(c));
    const std::optional<Move> move =
        in_place_result(in, out, counts, member(c), bytes_of(in_view.type));
    check(MPI_Reduce_scatter(move ? MPI_IN_PLACE : in.p, move ? in.p : out.p, counts.data(),
                             in.type, reduction(in_view, Reduce::Sum), c),
          "MPI_Reduce_scatter");
    if (move) move->apply();
  }

  void all_gather(int group, View in_view, View out_view, std::span<const int> counts) override {
    const Wire in = wire(in_view), out = wire(out_view, in_view.type);
    MPI_Comm c = comm(group);
    if (c == MPI_COMM_NULL) {
      copy(out, in);
      return;
    }
    expect_shapes("all-gather", out_view, in_view, counts, member(c));
    const std::vector<int> displs = displacements(counts);
    check(MPI_Allgatherv(gather_source(in, out, displs, member(c), in_view.type), in.n, in.type,
                         out.p, counts.data(), displs.data(), out.type, c),
          "MPI_Allgatherv");
  }

  void all_to_all(int group, View in_view, std::span<const int> in_counts, View out_view,
                  std::span<const int> out_counts) override {
    const Wire in = wire(in_view), out = wire(out_view, in_view.type);
    MPI_Comm c = comm(group);
    if (c == MPI_COMM_NULL) {
      copy(out, in);
      return;
    }
    expect_all_to_all_shapes(in_view, in_counts, out_view, out_counts);
    const std::vector<int> sd = displacements(in_counts), rd = displacements(out_counts);
    check(MPI_Alltoallv(in.p, in_counts.data(), sd.data(), in.type, out.p, out_counts.data(),
                        rd.data(), out.type, c),
          "MPI_Alltoallv");
  }

  Handle start_all_reduce(int group, View view) override {
    const Wire data = wire(view);
    MPI_Comm c = comm(group);
    if (c == MPI_COMM_NULL) return -1;
    MPI_Request request = MPI_REQUEST_NULL;
    check(MPI_Iallreduce(MPI_IN_PLACE, data.p, data.n, data.type, reduction(view, Reduce::Sum), c,
                         &request),
          "MPI_Iallreduce");
    return keep(request);
  }

  Handle start_reduce_scatter(int group, View in_view, View out_view,
                              std::span<const int> counts) override {
    const Wire in = wire(in_view), out = wire(out_view, in_view.type);
    MPI_Comm c = comm(group);
    if (c == MPI_COMM_NULL) {
      copy(out, in);
      return -1;
    }
    expect_shapes("reduce-scatter", in_view, out_view, counts, member(c));
    const std::optional<Move> move =
        in_place_result(in, out, counts, member(c), bytes_of(in_view.type));
    MPI_Request request = MPI_REQUEST_NULL;
    check(MPI_Ireduce_scatter(move ? MPI_IN_PLACE : in.p, move ? in.p : out.p, counts.data(),
                              in.type, reduction(in_view, Reduce::Sum), c, &request),
          "MPI_Ireduce_scatter");
    const Handle handle = keep(request);
    moves_.back() = move;
    return handle;
  }

  Handle start_all_gather(int group, View in_view, View out_view,
                          std::span<const int> counts) override {
    const Wire in = wire(in_view), out = wire(out_view, in_view.type);
    MPI_Comm c = comm(group);
    if (c == MPI_COMM_NULL) {
      copy(out, in);
      return -1;
    }
    expect_shapes("all-gather", out_view, in_view, counts, member(c));
    std::vector<int> displs = displacements(counts);
    MPI_Request request = MPI_REQUEST_NULL;
    check(MPI_Iallgatherv(gather_source(in, out, displs, member(c), in_view.type), in.n, in.type,
                          out.p, counts.data(), displs.data(), out.type, c, &request),
          "MPI_Iallgatherv");
    const Handle handle = keep(request);
    displs_.back() = std::move(displs);  // read until it completes; a moved vector stays put
    return handle;
  }

  void finish(Handle handle) override {
    if (handle < 0) return;
    const auto h = static_cast<std::size_t>(handle);
    if (!done_at_.at(h)) {
      check(MPI_Wait(&pending_.at(h), &status_[h]), "MPI_Wait");
      done_at_[h] = std::chrono::steady_clock::now();
    }
    check_received(h);
    if (moves_[h]) {
      moves_[h]->apply();
      moves_[h].reset();
    }
  }

  void progress() override {
    for (std::size_t h = 0; h < pending_.size(); ++h) {
      if (pending_[h] == MPI_REQUEST_NULL || done_at_[h]) continue;
      int done = 0;
      check(MPI_Test(&pending_[h], &done, &status_[h]), "MPI_Test");
      if (done) done_at_[h] = std::chrono::steady_clock::now();
    }
  }

  std::optional<std::chrono::steady_clock::time_point> completed_at(Handle handle) const override {
    if (handle < 0 || static_cast<std::size_t>(handle) >= done_at_.size()) return std::nullopt;
    return done_at_[static_cast<std::size_t>(handle)];
  }

  void send(int peer, std::int64_t tag, View view) override {
    const Wire data = wire(view);
    const auto* bytes = static_cast<const std::byte*>(data.p);
    buffers_.emplace_back(bytes, bytes + data.bytes);
    requests_.push_back(MPI_REQUEST_NULL);
    check(MPI_Isend(buffers_.back().data(), data.n, data.type, peer, checked_tag(tag),
                    MPI_COMM_WORLD, &requests_.back()),
          "MPI_Isend");
  }

  void recv(int peer, std::int64_t tag, View view) override {
    const Wire data = wire(view);
    MPI_Status status;
    check(MPI_Recv(data.p, data.n, data.type, peer, checked_tag(tag), MPI_COMM_WORLD, &status),
          "MPI_Recv");
    check_count(status, {peer, tag, data.n, data.type});
  }

  Handle start_recv(int peer, std::int64_t tag, View view) override {
    const Wire data = wire(view);
    MPI_Request request = MPI_REQUEST_NULL;
    check(MPI_Irecv(data.p, data.n, data.type, peer, checked_tag(tag), MPI_COMM_WORLD, &request),
          "MPI_Irecv");
    const Handle h = keep(request);
    expected_[static_cast<std::size_t>(h)] = {peer, tag, data.n, data.type};
    return h;
  }

  void finish_sends() override {
    if (requests_.empty()) return;
    check(MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE),
          "MPI_Waitall");
    requests_.clear();
    buffers_.clear();
  }

  void wait_sends() override {
    if (!pending_.empty()) {
      check(MPI_Waitall(static_cast<int>(pending_.size()), pending_.data(), MPI_STATUSES_IGNORE),
            "MPI_Waitall");
      for (auto& move : moves_) {
        if (move) move->apply();
      }
      pending_.clear();
      moves_.clear();
      displs_.clear();
      done_at_.clear();
      status_.clear();
      expected_.clear();
    }
    if (requests_.empty()) return;
    check(MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE),
          "MPI_Waitall");
    requests_.clear();
    buffers_.clear();
  }

  void all_ranks(std::span<double> data, Reduce op) override {
    check(MPI_Allreduce(MPI_IN_PLACE, data.data(), count_of(data.size()), MPI_DOUBLE,
                        op == Reduce::Sum ? MPI_SUM : MPI_MAX, MPI_COMM_WORLD),
          "MPI_Allreduce");
  }

  std::vector<std::string> gather_to_root(std::string mine) override {
    return texts_to_root(side_, std::move(mine));
  }

  void barrier() override { check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }

  ClockOffsets clock_offsets(const std::function<double()>& now) override {
    // Round trips per rank: enough that one meets neither a busy core nor a queued message
    // (the shortest is kept); a bound of dtexec's, not a modelling figure.
    constexpr int kRoundTrips = 16;
    constexpr int kTag = 1;  // on side_, apart from gather_to_root's parts (tag 0)
    ClockOffsets out;
    if (rank_ == 0) out.offset_s.assign(static_cast<std::size_t>(size_), 0.0);
    for (int r = 1; r < size_; ++r) {
      if (rank_ == 0) {
        double shortest = std::numeric_limits<double>::infinity();
        for (int k = 0; k < kRoundTrips; ++k) {
          const double sent = now();
          double read = 0;
          check(MPI_Send(&sent, 1, MPI_DOUBLE, r, kTag, side_), "MPI_Send");
          check(MPI_Recv(&read, 1, MPI_DOUBLE, r, kTag, side_, MPI_STATUS_IGNORE), "MPI_Recv");
          const double back = now();
          if (back - sent < shortest) {
            shortest = back - sent;
            out.offset_s[static_cast<std::size_t>(r)] = read - (sent + back) / 2;
          }
        }
        out.error_s = std::max(out.error_s, shortest / 2);
      } else if (rank_ == r) {
        for (int k = 0; k < kRoundTrips; ++k) {
          double ping = 0;
          check(MPI_Recv(&ping, 1, MPI_DOUBLE, 0, kTag, side_, MPI_STATUS_IGNORE), "MPI_Recv");
          const double read = now();
          check(MPI_Send(&read, 1, MPI_DOUBLE, 0, kTag, side_), "MPI_Send");
        }
      }
    }
    return out;
  }

 private:
  // This rank's place in a group's communicator.
  int member(MPI_Comm c) const {
    int r = -1;
    check(MPI_Comm_rank(c, &r), "MPI_Comm_rank");
    return r;
  }

  MPI_Comm comm(int group) const {
    DTSIM_ASSERT(group >= 0 && static_cast<std::size_t>(group) < comms_.size(),
                 fmt::format("group {} of a program with {} groups", group, comms_.size()));
    return comms_[static_cast<std::size_t>(group)];
  }

  // Handles index the requests of this step; wait_sends (at the step's end) retires them.
  Handle keep(MPI_Request request) {
    pending_.push_back(request);
    moves_.emplace_back();
    displs_.emplace_back();
    done_at_.emplace_back();
    status_.emplace_back();
    expected_.emplace_back();
    return static_cast<Handle>(pending_.size() - 1);
  }

  // A posted receive got the message it was posted for, whole (as the blocking recv checks).
  void check_received(std::size_t h) {
    if (expected_[h].elements >= 0) check_count(status_[h], expected_[h]);
  }

  struct Expected {
    int peer = -1;
    std::int64_t tag = -1;
    int elements = -1;  // -1: a collective, nothing to check
    MPI_Datatype type = MPI_DATATYPE_NULL;
  };
  void check_count(const MPI_Status& status, const Expected& e) const {
    int got = 0;
    check(MPI_Get_count(&status, e.type, &got), "MPI_Get_count");
    if (got != e.elements) {
      throw InternalError(
          fmt::format("rank {}: received {} elements from rank {} (tag {}), "
                      "expected {}",
                      rank_, got, e.peer, e.tag, e.elements));
    }
  }

  // A view as MPI moves it: fp32 as MPI_FLOAT, bf16 (the CPU's emulation) as 2-byte elements of
  // a type of this communicator's, reduced by its own operations. `same` (when given): the type
  // the view must share with the other end of a collective.
  struct Wire {
    void* p = nullptr;
    int n = 0;
    MPI_Datatype type = MPI_DATATYPE_NULL;
    std::size_t bytes = 0;
  };
  Wire wire(View v, std::optional<Dtype> same = std::nullopt) const {
    DTSIM_ASSERT(v.type == Dtype::F32 || v.type == Dtype::BF16,
                 fmt::format("an fp32 or bf16 view to move over MPI, given {}", to_string(v.type)));
    DTSIM_ASSERT(!same || *same == v.type, "the views of a collective share one type");
    const bool bf16 = v.type == Dtype::BF16;
    return {v.p, count_of(static_cast<std::size_t>(v.n)), bf16 ? bf16_ : MPI_FLOAT,
            static_cast<std::size_t>(v.n) * bytes_of(v.type)};
  }
  MPI_Op reduction(View v, Reduce op) const {
    if (v.type == Dtype::BF16) return op == Reduce::Sum ? bf16_sum_ : bf16_max_;
    return op == Reduce::Sum ? MPI_SUM : MPI_MAX;
  }
  // A reduce-scatter in place (`out` is this member's part of `in`, at its place there): MPI's
  // MPI_IN_PLACE leaves the member's result at the start of the buffer, moved to its place
  // once the collective is done (rank 0's is there already).
  struct Move {
    void* to = nullptr;
    const void* from = nullptr;
    std::size_t bytes = 0;
    void apply() const {
      if (to != from && bytes > 0) std::memmove(to, from, bytes);
    }
  };
  static std::optional<Move> in_place_result(const Wire& in, const Wire& out,
                                             std::span<const int> counts, int me,
                                             std::size_t element) {
    std::size_t before = 0;
    for (std::size_t r = 0; r < static_cast<std::size_t>(me); ++r) {
      before += static_cast<std::size_t>(counts[r]);
    }
    if (out.p != static_cast<std::byte*>(in.p) + before * element) {
      DTSIM_ASSERT(!overlap(in, out), "a reduce-scatter's views overlap, not in place");
      return std::nullopt;
    }
    return Move{out.p, in.p, out.bytes};
  }
  static bool overlap(const Wire& a, const Wire& b) {
    const auto* a0 = static_cast<const std::byte*>(a.p);
    const auto* b0 = static_cast<const std::byte*>(b.p);
    return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
  }
  // An all-gather's send buffer: MPI_IN_PLACE where this member's part already lies at its
  // place in `out`; else `in`, which must not overlap `out`.
  static const void* gather_source(const Wire& in, const Wire& out, std::span<const int> displs,
                                   int me, Dtype type) {
    const bool in_place =
        in.p == static_cast<std::byte*>(out.p) +
                    static_cast<std::size_t>(displs[static_cast<std::size_t>(me)]) * bytes_of(type);
    DTSIM_ASSERT(in_place || !overlap(in, out), "an all-gather's views overlap, not in place");
    return in_place ? MPI_IN_PLACE : in.p;
  }

  static void copy(const Wire& out, const Wire& in) {
    if (in.p != out.p && in.bytes > 0) std::memmove(out.p, in.p, std::min(in.bytes, out.bytes));
  }

  int checked_tag(std::int64_t tag) const {
    if (tag < 0 || tag > tag_ub_) {
      throw UnsupportedError(fmt::format(
          "message tag {} exceeds this MPI's limit {} (too many micro-batches x chunks)", tag,
          tag_ub_));
    }
    return static_cast<int>(tag);
  }

  // Where each member's piece starts in a buffer of consecutive pieces of `counts` elements.
  static std::vector<int> displacements(std::span<const int> counts) {
    std::vector<int> d(counts.size(), 0);
    for (std::size_t i = 1; i < counts.size(); ++i) d[i] = d[i - 1] + counts[i - 1];
    return d;
  }

  int rank_ = 0, size_ = 1, tag_ub_ = 32767;
  MPI_Comm side_ = MPI_COMM_NULL;
  std::vector<MPI_Comm> comms_;
  std::vector<std::vector<int>> members_;
  MPI_Datatype bf16_ = MPI_DATATYPE_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL, bf16_max_ = MPI_OP_NULL;
  std::deque<std::vector<std::byte>> buffers_;
  std::vector<MPI_Request> requests_;
  std::vector<MPI_Request> pending_;        // non-blocking collectives by handle
  std::vector<std::optional<Move>> moves_;  // an in-place reduce-scatter's, by handle
  std::vector<std::vector<int>> displs_;    // a started all-gather's displacements, by handle
  // When each was first seen complete.
  std::vector<std::optional<std::chrono::steady_clock::time_point>> done_at_;
  std::vector<MPI_Status> status_;
  std::vector<Expected> expected_;  // posted receives
};

}  // namespace

MpiSession::MpiSession() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    // Funneled: only this thread calls MPI; dtexec's other threads (the watchdog, an
    // asynchronous checkpoint's writer) make no MPI call but its abort.
    int provided = MPI_THREAD_SINGLE;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  }
  // (Were it not set, a failing call would end the process in MPI, without rank or host.)
  if (MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN) != MPI_SUCCESS) {
    std::cerr << "dtexec: MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN) failed\n";
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
  host_ = host_name();
  // The ranks sharing this host (MPI_COMM_TYPE_SHARED): this rank's place among them.
  MPI_Comm local = MPI_COMM_NULL;
  check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local),
        "MPI_Comm_split_type");
  check(MPI_Comm_rank(local, &local_rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(local, &local_size_), "MPI_Comm_size");
  MPI_Comm_free(&local);
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

nlohmann::json measure_collectives(const MpiSession& session, bool quick, int repeats,
                                   double timeout_s) {
  const int n = session.size();
  nlohmann::json table = nlohmann::json::array();
  if (n < 2) return table;
  std::vector<std::size_t> sizes;
  for (std::size_t bytes = 4096; bytes <= (quick ? (1u << 16) : (64u << 20)); bytes *= 4) {
    sizes.push_back(bytes);
  }
  // What a collective of a training step meets: caches that the compute since the last one
  // filled with other data, and an input that compute has just written. Timed in a loop over
  // the same buffers they ran from cache instead: a 1 MiB all-gather over 2 ranks took 74.5 us
  // there, and 300-630 us inside cpu-small's steps at cp 2 (its K and V, 2026-12-07). So each
  // repeat first writes a scratch buffer larger than a core's share of the last-level cache,
  // then the op's input (`input`, this rank's), and only then meets the other ranks.
  constexpr std::size_t kScratchBytes = std::size_t{64} << 20;
  std::vector<float> scratch(kScratchBytes / sizeof(float));
  float stamp = 0;
  const auto cold = [&](std::vector<float>& input) {
    stamp += 1;
    std::fill(scratch.begin(), scratch.end(), stamp);
    std::fill(input.begin(), input.end(), 1.0f);
  };
  // A row: the median over repeats of the slowest rank's time of `op`, every rank of the job
  // taking part (a group's collective runs in every group at once). The process ends if the
  // measurement takes longer than timeout_s (a peer that failed or hangs).
  auto measure = [&](const char* kind, int ranks, std::size_t bytes, double factor,
                     std::vector<float>& input, auto&& op, bool started = false) {
    const Deadline deadline(
        timeout_s,
        fmt::format("dtexec calibrate: rank {} on {}: the {} of {} bytes over {} ranks did not "
                    "finish within {} s (--collective-timeout): a peer failed or hangs; ending "
                    "the job",
                    session.rank(), session.host(), kind, bytes, ranks, timeout_s));
    op();
    std::vector<double> times;
    for (int r = 0; r < repeats; ++r) {
      cold(input);
      check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
      const double t0 = MPI_Wtime();
      op();
      double t = MPI_Wtime() - t0;
      check(MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD),
            "MPI_Allreduce");
      times.push_back(t);
    }
    const double seconds = median(std::move(times));
    const double algbw = static_cast<double>(bytes) / seconds;
    nlohmann::json row = {{"kind", kind},
                          {"ranks", ranks},
                          {"bytes", bytes},
                          {"seconds", seconds},
                          {"algbw_bytes_per_s", algbw},
                          {"busbw_bytes_per_s", algbw * factor}};
    if (started) row["started"] = true;
    table.push_back(std::move(row));
  };
  // The same collective started and waited for at once, as dtexec runs the data-parallel
  // stream's (Open MPI's non-blocking collectives, libnbc, move the data in rounds of their
  // own: 2 ranks, 14.9 MB all-reduced, 3-5 ms blocking and 7-9 ms started).
  const auto wait = [](MPI_Request request) {
    check(MPI_Wait(&request, MPI_STATUS_IGNORE), "MPI_Wait");
  };
  for (const int g : collective_group_sizes(n)) {
    MPI_Comm comm = MPI_COMM_WORLD;
    if (g < n) {
      check(MPI_Comm_split(MPI_COMM_WORLD, session.rank() / g, session.rank(), &comm),
            "MPI_Comm_split");
    }
    const double ring = static_cast<double>(g - 1) / g;
    for (std::size_t bytes : sizes) {
      const std::size_t count = bytes / sizeof(float);
      const std::size_t part = count / static_cast<std::size_t>(g);
      const std::size_t parts_bytes = part * static_cast<std::size_t>(g) * sizeof(float);
      std::vector<float> buffer(count, 1.0f), out(count, 0.0f);
      measure("all_reduce", g, bytes, 2 * ring, buffer, [&] {
        check(MPI_Allreduce(MPI_IN_PLACE, buffer.data(), static_cast<int>(count), MPI_FLOAT,
                            MPI_SUM, comm),
              "MPI_Allreduce");
      });
      measure("all_gather", g, parts_bytes, ring, buffer, [&] {
        check(MPI_Allgather(buffer.data(), static_cast<int>(part), MPI_FLOAT, out.data(),
                            static_cast<int>(part), MPI_FLOAT, comm),
              "MPI_Allgather");
      });
      measure("reduce_scatter", g, parts_bytes, ring, buffer, [&] {
        check(MPI_Reduce_scatter_block(buffer.data(), out.data(), static_cast<int>(part), MPI_FLOAT,
                                       MPI_SUM, comm),
              "MPI_Reduce_scatter_block");
      });
      measure(
          "all_reduce", g, bytes, 2 * ring, buffer,
          [&] {
            MPI_Request r;
            check(MPI_Iallreduce(MPI_IN_PLACE, buffer.data(), static_cast<int>(count), MPI_FLOAT,
                                 MPI_SUM, comm, &r),
                  "MPI_Iallreduce");
            wait(r);
          },
          true);
      measure(
          "all_gather", g, parts_bytes, ring, buffer,
          [&] {
            MPI_Request r;
            check(MPI_Iallgather(buffer.data(), static_cast<int>(part), MPI_FLOAT, out.data(),
                                 static_cast<int>(part), MPI_FLOAT, comm, &r),
                  "MPI_Iallgather");
            wait(r);
          },
          true);
      measure(
          "reduce_scatter", g, parts_bytes, ring, buffer,
          [&] {
            MPI_Request r;
            check(MPI_Ireduce_scatter_block(buffer.data(), out.data(), static_cast<int>(part),
                                            MPI_FLOAT, MPI_SUM, comm, &r),
                  "MPI_Ireduce_scatter_block");
            wait(r);
          },
          true);
      // Expert parallelism's dispatch and combine: every rank sends a part to every rank
      // (bytes: what a rank sends in all, as nccl-tests' alltoall counts them).
      measure("all_to_all", g, parts_bytes, ring, buffer, [&] {
        check(MPI_Alltoall(buffer.data(), static_cast<int>(part), MPI_FLOAT, out.data(),
                           static_cast<int>(part), MPI_FLOAT, comm),
              "MPI_Alltoall");
      });
    }
    if (comm != MPI_COMM_WORLD) check(MPI_Comm_free(&comm), "MPI_Comm_free");
  }
  // A pipeline transfer: ranks 0 to 1, the others idle.
  for (std::size_t bytes : sizes) {
    const std::size_t count = bytes / sizeof(float);
    std::vector<float> buffer(count, 1.0f), out(count, 0.0f);
    measure("send_recv", 2, bytes, 1.0, buffer, [&] {
      if (session.rank() == 0) {
        check(MPI_Send(buffer.data(), static_cast<int>(count), MPI_FLOAT, 1, 7, MPI_COMM_WORLD),
              "MPI_Send");
      } else if (session.rank() == 1) {
        check(MPI_Recv(out.data(), static_cast<int>(count), MPI_FLOAT, 0, 7, MPI_COMM_WORLD,
                       MPI_STATUS_IGNORE),
              "MPI_Recv");
      }
    });
  }
  return table;
}

void MpiSession::barrier() const {
  check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
}

double MpiSession::mean(double value) const {
  double sum = 0;
  check(MPI_Allreduce(&value, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
  return sum / size_;
}

double MpiSession::max(double value) const {
  double out = 0;
  check(MPI_Allreduce(&value, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD), "MPI_Allreduce");
  return out;
}

void MpiSession::broadcast(void* data, std::size_t bytes) const {
  check(MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast");
}

std::vector<double> MpiSession::all_gather(const std::vector<double>& mine) const {
  std::vector<double> all(mine.size() * static_cast<std::size_t>(size_));
  check(MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_DOUBLE, all.data(),
                      static_cast<int>(mine.size()), MPI_DOUBLE, MPI_COMM_WORLD),
        "MPI_Allgather");
  return all;
}

std::vector<std::string> MpiSession::gather_to_root(const std::string& mine) const {
  // On a communicator of its own: the world may hold receives posted ahead by a step that
  // failed, which a message of this gather could match.
  MPI_Comm own = MPI_COMM_NULL;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &own), "MPI_Comm_dup");
  auto out = texts_to_root(own, mine);
  MPI_Comm_free(&own);
  return out;
}

void MpiSession::abort(int code) const {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();
}

std::unique_ptr<Comm> make_mpi_comm(const MpiSession& session, const lower::Program& program) {
  return std::make_unique<MpiComm>(session, program);
}

}  // namespace dtsim::exec::cpu
