#include "exec/cuda/nccl_comm.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "exec/core/deadline.hpp"
#include "exec/core/p2p_order.hpp"
#include "exec/cuda/check.cuh"  // teardown
#include "exec/cuda/device.hpp"

namespace dtsim::exec::cuda {

namespace {

ncclDataType_t nccl_type(Dtype t) {
  switch (t) {
    case Dtype::F32:
      return ncclFloat32;
    case Dtype::BF16:
      return ncclBfloat16;
    case Dtype::I32:
      return ncclInt32;
    case Dtype::U8:
      return ncclUint8;
  }
  return ncclFloat32;
}

std::size_t count(const View& v) {
  return static_cast<std::size_t>(v.n);
}

// (sender, receiver) of every pipeline transfer, ordered: the same sequence on every rank.
std::set<std::pair<std::int64_t, std::int64_t>> pipeline_pairs(const lower::Program& program) {
  std::set<std::pair<std::int64_t, std::int64_t>> pairs;
  for (const auto& rp : program.ranks) {
    for (const auto& t : rp.tasks) {
      if (t.kind == lower::TaskKind::Send) {
        pairs.insert({rp.rank, program.ranks.at(static_cast<std::size_t>(t.peer)).rank});
      }
    }
  }
  return pairs;
}

class NcclComm final : public Comm {
 public:
  NcclComm(const cpu::MpiSession& session, const lower::Program& program, Device& device,
           double timeout_s)
      // The MPI communicators carry what stays on the host (losses, checkpoints, barriers);
      // making them also checks the program against the job's size.
      : session_(session),
        host_(cpu::make_mpi_comm(session, program)),
        device_(device),
        compute_(static_cast<cudaStream_t>(stream_of(device))),
        timeout_s_(timeout_s),
        gpu_(gpu_of(device)),
        rank_(session.rank()),
        size_(session.size()) {
    if (auto mismatch = untagged_p2p_mismatch(program)) {
      throw UnsupportedError(
          fmt::format("--backend cuda: NCCL transfers carry no tag, and {}", *mismatch));
    }
    const dtsim::exec::Deadline setup(
        timeout_s_,
        fmt::format("dtexec: rank {} on {}: the NCCL communicators were not set up within {} s "
                    "(--task-timeout): a peer failed, cannot be reached, or disagrees on the plan",
                    rank_, session.host(), timeout_s_));
    cuda(cudaSetDevice(gpu_), "cudaSetDevice");
    cuda(cudaEventCreateWithFlags(&fence_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    // Connections at initialisation, not at first use: a first use that sets up connections
    // waits on the host for the peers, which would make the first send of a step blocking.
    setenv("NCCL_RUNTIME_CONNECT", "0", 0);
    ncclUniqueId id{};
    if (rank_ == 0) nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    session.broadcast(&id, sizeof id);
    nccl(ncclCommInitRank(&world_, size_, id, rank_), "ncclCommInitRank");
    comms_.push_back(world_);

    // A communicator per group: every rank takes part in every split (the job's communicator is
    // split collectively), members with the group's index as colour and their ring position as
    // key, so that a member's NCCL rank is its place in the group.
    groups_.resize(program.groups.size());
    for (std::size_t g = 0; g < program.groups.size(); ++g) {
      const auto& ranks = program.groups[g].ranks;
      if (ranks.size() < 2) continue;  // the same on every rank: no split
      const auto at = std::find(ranks.begin(), ranks.end(), static_cast<std::int64_t>(rank_));
      const bool member = at != ranks.end();
      const int index = member ? static_cast<int>(at - ranks.begin()) : 0;
      ncclComm_t c = nullptr;
      nccl(ncclCommSplit(world_, member ? static_cast<int>(g) : NCCL_SPLIT_NOCOLOR, index, &c,
                         nullptr),
           "ncclCommSplit (group)");
      if (!member) continue;
      comms_.push_back(c);
      groups_[g] = {c, new_stream(), index, ranks.size()};
    }

    // A communicator of two per direction of each pair that exchanges pipeline tensors: the
    // sender is its rank 0 and uses it from its send stream only, the receiver its rank 1 and
    // uses it from the compute stream only (with overlap_p2p_comm: from its receive stream for
    // that sender only).
    const auto pairs = pipeline_pairs(program);
    for (const auto& [from, to] : pairs) {
      const bool in = rank_ == from || rank_ == to;
      ncclComm_t c = nullptr;
      nccl(ncclCommSplit(world_, in ? 0 : NCCL_SPLIT_NOCOLOR, rank_ == from ? 0 : 1, &c, nullptr),
           "ncclCommSplit (pipeline pair)");
      if (!in) continue;
      comms_.push_back(c);
      if (rank_ == from) {
        sends_[static_cast<int>(to)] = {c, new_stream(), 0, 2};
      } else {
        recvs_[static_cast<int>(from)] = c;
      }
    }
    warm_up(pairs, exchanging_groups(program));
    watcher_ = std::thread([this] { watch(); });
  }

  ~NcclComm() override {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (watcher_.joinable()) watcher_.join();
    // (Nothing may throw here: a failed call is said on stderr, not lost.)
    for (cudaStream_t s : streams_) teardown(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    for (const Staged& v : staged_) {
      device_.release(v.copy);
      teardown(cudaEventDestroy(v.sent), "cudaEventDestroy");
    }
    for (cudaEvent_t e : spare_events_) teardown(cudaEventDestroy(e), "cudaEventDestroy");
    for (auto it = comms_.rbegin(); it != comms_.rend(); ++it) {
      teardown(ncclCommDestroy(*it), "ncclCommDestroy");
    }
    for (cudaStream_t s : streams_) teardown(cudaStreamDestroy(s), "cudaStreamDestroy");
    for (cudaEvent_t e : done_) teardown(cudaEventDestroy(e), "cudaEventDestroy");
    if (fence_ != nullptr) teardown(cudaEventDestroy(fence_), "cudaEventDestroy");
  }

  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool moves_device_memory() const override { return true; }

  void all_reduce(int group, View data, Reduce op) override {
    const Channel* g = member_of(group);
    if (g == nullptr || data.empty()) return;
    after_compute(g->stream);
    nccl(ncclAllReduce(data.p, data.p, count(data), nccl_type(data.type),
                       op == Reduce::Sum ? ncclSum : ncclMax, g->comm, g->stream),
         "ncclAllReduce");
    before_compute(g->stream);
  }

  void reduce_scatter(int group, View in, View out, std::span<const int> counts) override {
    const Channel* g = member_of(group);
    if (g == nullptr) {
      device_.copy(out, in);
      return;
    }
    after_compute(g->stream);
    enqueue_reduce_scatter(*g, in, out, counts);
    before_compute(g->stream);
  }

  void all_gather(int group, View in, View out, std::span<const int> counts) override {
    const Channel* g = member_of(group);
    if (g == nullptr) {
      device_.copy(out, in);
      return;
    }
    after_compute(g->stream);
    enqueue_all_gather(*g, in, out, counts);
    before_compute(g->stream);
  }

  // Expert parallelism's exchange: a send and a receive per member, grouped (NCCL has no
  // all-to-all of its own; grouped point-to-point is its documented form of one).
  void all_to_all(int group, View in, std::span<const int> in_counts, View out,
                  std::span<const int> out_counts) override {
    const Channel* g = member_of(group);
    if (g == nullptr) {
      device_.copy(out, in);
      return;
    }
    DTSIM_ASSERT(in_counts.size() == g->members && out_counts.size() == g->members,
                 "one count per member each way");
    expect_all_to_all_shapes(in, in_counts, out, out_counts);
    after_compute(g->stream);
    nccl(ncclGroupStart(), "ncclGroupStart");
    std::int64_t sent = 0, received = 0;
    for (std::size_t r = 0; r < g->members; ++r) {
      if (in_counts[r] > 0) {
        nccl(ncclSend(in.sub(sent, in_counts[r]).p, static_cast<std::size_t>(in_counts[r]),
                      nccl_type(in.type), static_cast<int>(r), g->comm, g->stream),
             "ncclSend");
      }
      if (out_counts[r] > 0) {
        nccl(ncclRecv(out.sub(received, out_counts[r]).p, static_cast<std::size_t>(out_counts[r]),
                      nccl_type(out.type), static_cast<int>(r), g->comm, g->stream),
             "ncclRecv");
      }
      sent += in_counts[r];
      received += out_counts[r];
    }
    nccl(ncclGroupEnd(), "ncclGroupEnd");
    before_compute(g->stream);
  }

  Handle start_all_reduce(int group, View data) override {
    const Channel* g = member_of(group);
    if (g == nullptr || data.empty()) return -1;
    return started(*g, [&] {
      nccl(ncclAllReduce(data.p, data.p, count(data), nccl_type(data.type), ncclSum, g->comm,
                         g->stream),
           "ncclAllReduce");
    });
  }

  Handle start_reduce_scatter(int group, View in, View out, std::span<const int> counts) override {
    const Channel* g = member_of(group);
    if (g == nullptr) {
      device_.copy(out, in);
      return -1;
    }
    return started(*g, [&] { enqueue_reduce_scatter(*g, in, out, counts); });
  }

  // On the group's stream after the compute queued so far (the rank's slice copied in), which
  // waits for it at finish(handle): the units that read the weights, not the compute between.
  Handle start_all_gather(int group, View in, View out, std::span<const int> counts) override {
    const Channel* g = member_of(group);
    if (g == nullptr) {
      device_.copy(out, in);
      return -1;
    }
    return started(*g, [&] { enqueue_all_gather(*g, in, out, counts); });
  }

  std::optional<TransferMarks> take_transfer_marks() override {
    return std::exchange(transfer_, std::nullopt);
  }

  // Done on the device (its event has passed): waiting for it costs the compute stream nothing.
  bool complete(Handle handle) override {
    if (handle < 0) return true;
    DTSIM_ASSERT(handle < used_, "a handle of this step");
    return passed(done_[static_cast<std::size_t>(handle)]);
  }

  void finish(Handle handle) override {
    if (handle < 0) return;
    DTSIM_ASSERT(handle < used_, "a handle of this step");
    cuda(cudaStreamWaitEvent(compute_, done_[static_cast<std::size_t>(handle)], 0),
         "cudaStreamWaitEvent");
  }

  void send(int peer, std::int64_t, View data) override {
    const auto it = sends_.find(peer);
    DTSIM_ASSERT(it != sends_.end(), fmt::format("rank {} sends to rank {}", rank_, peer));
    if (data.empty()) return;
    reclaim_sent();
    // The tensor may be released and its memory reused once this returns: send a copy, kept
    // until its send is done (reclaim_sent, finish_sends, wait_sends).
    const View staged = device_.allocate_for_overwrite(data.n, data.type);  // copied whole
    device_.copy(staged, data);
    after_compute(it->second.stream);
    transfer_begins(it->second.stream);
    nccl(ncclSend(staged.p, count(staged), nccl_type(staged.type), 1, it->second.comm,
                  it->second.stream),
         "ncclSend");
    transfer_ends(it->second.stream);
    cudaEvent_t sent = nullptr;
    if (spare_events_.empty()) {
      cuda(cudaEventCreateWithFlags(&sent, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    } else {
      sent = spare_events_.back();
      spare_events_.pop_back();
    }
    cuda(cudaEventRecord(sent, it->second.stream), "cudaEventRecord");
    staged_.push_back({staged, sent});
  }

  void recv(int peer, std::int64_t, View data) override {
    const auto it = recvs_.find(peer);
    DTSIM_ASSERT(it != recvs_.end(), fmt::format("rank {} receives from rank {}", rank_, peer));
    if (data.empty()) return;
    nccl(ncclRecv(data.p, count(data), nccl_type(data.type), 0, it->second, compute_), "ncclRecv");
  }

  // Posted ahead of need: on the sending pair's receive stream (one per peer), after what the
  // compute stream queued so far (the buffer's zeroing); finish() makes compute wait for it.
  Handle start_recv(int peer, std::int64_t, View data) override {
    const auto it = recvs_.find(peer);
    DTSIM_ASSERT(it != recvs_.end(), fmt::format("rank {} receives from rank {}", rank_, peer));
    if (data.empty()) return -1;
    cudaStream_t& s = recv_streams_[peer];
    if (s == nullptr) s = new_stream();
    after_compute(s);
    nccl(ncclRecv(data.p, count(data), nccl_type(data.type), 0, it->second, s), "ncclRecv");
    return done_on(s);
  }

  // Compute waits on the GPU, not the host, for every pair's sends queued so far; their copies
  // can go back to the device's pool then (what reuses them comes later on the compute stream),
  // as the MPI backend frees its send buffers here.
  void finish_sends() override {
    for (const auto& [peer, pair] : sends_) before_compute(pair.stream);
    release_staged([](cudaEvent_t) { return true; });
  }

  // The step's end: every queued kernel and transfer of this rank done, or a hang reported.
  void wait_sends() override {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    std::vector<cudaStream_t> all = streams_;
    all.push_back(compute_);
    for (cudaStream_t s : all) {
      for (;;) {
        const cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) cuda(e, "cudaStreamQuery");
        (void)cudaGetLastError();  // not ready is no error: see complete()
        if (timeout_s_ > 0 && std::chrono::steady_clock::now() > deadline) {
          end_job(fmt::format(
              "the step's GPU work (kernels and NCCL transfers) did not finish within {} s "
              "(--task-timeout): a peer failed or the ranks disagree on their collectives",
              timeout_s_));
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    release_staged([](cudaEvent_t) { return true; });
    used_ = 0;
  }

  void all_ranks(std::span<double> data, Reduce op) override { host_->all_ranks(data, op); }
  std::vector<std::string> gather_to_root(std::string mine) override {
    return host_->gather_to_root(std::move(mine));
  }
  ClockOffsets clock_offsets(const std::function<double()>& now) override {
    return host_->clock_offsets(now);
  }
  void barrier() override { host_->barrier(); }
  void abort_communicators() noexcept override {
    // Once, as end_job's: the watcher may be ending the job at the same time.
    if (ending().exchange(true)) return;
    abort_all();
  }

 private:
  struct Channel {
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
    int index = 0;            // this rank's NCCL rank in it
    std::size_t members = 0;  // NCCL ranks
  };

  const Channel* member_of(int group) const {
    DTSIM_ASSERT(group >= 0 && static_cast<std::size_t>(group) < groups_.size(),
                 fmt::format("group {} of a program with {} groups", group, groups_.size()));
    const Channel& g = groups_[static_cast<std::size_t>(group)];
    return g.comm == nullptr ? nullptr : &g;
  }

  // Whether the GPU has passed `e`, without waiting.
  bool passed(cudaEvent_t e) {
    const cudaError_t r = cudaEventQuery(e);
    if (r == cudaErrorNotReady) {
      // Not an error, but the runtime may hold it as the last error, which the next kernel
      // launch's check would read: clear it (launch errors were checked as they were queued).
      (void)cudaGetLastError();
      return false;
    }
    cuda(r, "cudaEventQuery");
    return true;
  }

  // The copies of sends whose event says the GPU has sent them (no wait).
  void reclaim_sent() {
    release_staged([this](cudaEvent_t sent) { return passed(sent); });
  }
  template <class Done>
  void release_staged(Done done) {
    std::erase_if(staged_, [&](const Staged& s) {
      if (!done(s.sent)) return false;
      device_.release(s.copy);
      spare_events_.push_back(s.sent);
      return true;
    });
  }

  static bool equal(std::span<const int> counts) {
    return std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; });
  }

  // out = every member's in, in member order (in place where `in` is this member's part of
  // `out`, at its place there: NCCL's in-place forms).
  void enqueue_all_gather(const Channel& g, View in, View out, std::span<const int> counts) {
    DTSIM_ASSERT(counts.size() == g.members, "one count per member");
    expect_shapes("all-gather", out, in, counts, g.index);
    if (equal(counts)) {
      if (counts[0] > 0) {
        nccl(ncclAllGather(in.p, out.p, static_cast<std::size_t>(counts[0]), nccl_type(in.type),
                           g.comm, g.stream),
             "ncclAllGather");
      }
      return;
    }
    // Unequal shards: member r broadcasts its part into its place.
    nccl(ncclGroupStart(), "ncclGroupStart");
    std::int64_t offset = 0;
    for (std::size_t r = 0; r < counts.size(); ++r) {
      if (counts[r] > 0) {
        nccl(ncclBroadcast(in.p, out.sub(offset, counts[r]).p, static_cast<std::size_t>(counts[r]),
                           nccl_type(in.type), static_cast<int>(r), g.comm, g.stream),
             "ncclBroadcast");
      }
      offset += counts[r];
    }
    nccl(ncclGroupEnd(), "ncclGroupEnd");
  }

  void enqueue_reduce_scatter(const Channel& g, View in, View out, std::span<const int> counts) {
    DTSIM_ASSERT(counts.size() == g.members, "one count per member");
    expect_shapes("reduce-scatter", in, out, counts, g.index);
    if (equal(counts)) {
      if (counts[0] > 0) {
        nccl(ncclReduceScatter(in.p, out.p, static_cast<std::size_t>(counts[0]), nccl_type(in.type),
                               ncclSum, g.comm, g.stream),
             "ncclReduceScatter");
      }
      return;
    }
    // Unequal shards: member r receives the sum of everyone's part r.
    nccl(ncclGroupStart(), "ncclGroupStart");
    std::int64_t offset = 0;
    for (std::size_t r = 0; r < counts.size(); ++r) {
      if (counts[r] > 0) {
        nccl(ncclReduce(in.sub(offset, counts[r]).p, out.p, static_cast<std::size_t>(counts[r]),
                        nccl_type(in.type), ncclSum, static_cast<int>(r), g.comm, g.stream),
             "ncclReduce");
      }
      offset += counts[r];
    }
    nccl(ncclGroupEnd(), "ncclGroupEnd");
  }

  // The groups whose tasks include an all-to-all (expert and context parallelism's exchanges).
  static std::set<int> exchanging_groups(const lower::Program& program) {
    std::set<int> groups;
    for (const auto& rp : program.ranks) {
      for (const auto& t : rp.tasks) {
        if (t.kind == lower::TaskKind::Collective &&
            t.collective == lower::CollectiveKind::AllToAll) {
          groups.insert(t.group);
        }
      }
    }
    return groups;
  }

  // One small operation on every communicator, in the order they were made (on every rank the
  // lowest pending one has all its members at it, so this cannot deadlock), waited for on the
  // host: whatever NCCL still sets up at first use is done before the first step. A group that
  // exchanges all-to-all also sends one value to every member: NCCL connects point-to-point
  // channels at their first use, whatever NCCL_RUNTIME_CONNECT says of the collectives'.
  void warm_up(const std::set<std::pair<std::int64_t, std::int64_t>>& pairs,
               const std::set<int>& exchanging) {
    const View one = device_.allocate(1, Dtype::F32);
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const Channel* c = member_of(static_cast<int>(g));
      if (c == nullptr) continue;
      all_reduce(static_cast<int>(g), one, Reduce::Sum);
      if (exchanging.count(static_cast<int>(g)) > 0) {
        const View in = device_.allocate(static_cast<std::int64_t>(c->members), Dtype::F32);
        const View out = device_.allocate(static_cast<std::int64_t>(c->members), Dtype::F32);
        const std::vector<int> each(c->members, 1);
        all_to_all(static_cast<int>(g), in, each, out, each);
        // The compute stream waits for the exchange: reuse of these buffers comes after it.
        device_.release(in);
        device_.release(out);
      }
      cuda(cudaStreamSynchronize(compute_), "cudaStreamSynchronize");
    }
    for (const auto& [from, to] : pairs) {
      if (rank_ == from) {
        const Channel& s = sends_.at(static_cast<int>(to));
        after_compute(s.stream);
        nccl(ncclSend(one.p, 1, ncclFloat32, 1, s.comm, s.stream), "ncclSend");
        cuda(cudaStreamSynchronize(s.stream), "cudaStreamSynchronize");
      } else if (rank_ == to) {
        nccl(ncclRecv(one.p, 1, ncclFloat32, 0, recvs_.at(static_cast<int>(from)), compute_),
             "ncclRecv");
        cuda(cudaStreamSynchronize(compute_), "cudaStreamSynchronize");
      }
    }
    device_.release(one);
  }

  cudaStream_t new_stream() {
    cudaStream_t s = nullptr;
    cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    streams_.push_back(s);
    return s;
  }

  // `s` starts after the work queued on the compute stream so far; the compute stream's later
  // work starts after what is queued on `s`.
  void after_compute(cudaStream_t s) {
    cuda(cudaEventRecord(fence_, compute_), "cudaEventRecord");
    cuda(cudaStreamWaitEvent(s, fence_, 0), "cudaStreamWaitEvent");
  }
  void before_compute(cudaStream_t s) {
    cuda(cudaEventRecord(fence_, s), "cudaEventRecord");
    cuda(cudaStreamWaitEvent(compute_, fence_, 0), "cudaStreamWaitEvent");
  }

  // The device's marks around a started collective or a send queued on `s`
  // (take_transfer_marks): the first one's start since the last take, the last one's end.
  void transfer_begins(cudaStream_t s) {
    const int m = mark_on(device_, s);
    if (!transfer_) transfer_ = TransferMarks{m, m};
  }
  void transfer_ends(cudaStream_t s) { transfer_->end = mark_on(device_, s); }

  // A started collective: `enqueue` queues it on the group's stream after the compute queued
  // so far, its transfer marks around it; the handle of its done event.
  template <typename Enqueue>
  Handle started(const Channel& g, Enqueue&& enqueue) {
    after_compute(g.stream);
    transfer_begins(g.stream);
    std::forward<Enqueue>(enqueue)();
    transfer_ends(g.stream);
    return done_on(g.stream);
  }

  // An event after the work queued on `s`: the handle that finish() makes compute wait for.
  Handle done_on(cudaStream_t s) {
    if (static_cast<std::size_t>(used_) == done_.size()) {
      cudaEvent_t e = nullptr;
      cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      done_.push_back(e);
    }
    cuda(cudaEventRecord(done_[static_cast<std::size_t>(used_)], s), "cudaEventRecord");
    return used_++;
  }

  void cuda(cudaError_t e, const char* call) {
    if (e != cudaSuccess) {
      end_job(fmt::format("{} failed: {} (error {})", call, cudaGetErrorString(e),
                          static_cast<int>(e)));
    }
  }
  void nccl(ncclResult_t r, const char* call) {
    if (r != ncclSuccess) {
      end_job(fmt::format("{} failed: {} (result {})", call, ncclGetErrorString(r),
                          static_cast<int>(r)));
    }
  }

  // A failed call leaves collectives that the peers cannot finish: abort the communicators
  // (their kernels return) and end this rank; mpirun ends the others.
  // Once per process: the watcher and the main thread may both get here, and a communicator
  // must not be aborted twice or while the other thread still uses it. An abort that does not
  // return within 30 s is cut short (SIGALRM ends the process).
  [[noreturn]] void end_job(const std::string& what) {
    if (ending().exchange(true)) {
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    std::cerr << fmt::format("dtexec: rank {} on {}: {}; aborting the NCCL communicators\n", rank_,
                             session_.host(), what);
    std::cerr.flush();
    abort_all();
    std::_Exit(3);
  }
  // Whether the job is being ended (by end_job or abort_communicators): once per process.
  static std::atomic<bool>& ending() {
    static std::atomic<bool> flag{false};
    return flag;
  }
  // Every communicator aborted, the job's last; an abort that does not return within 30 s is
  // cut short (SIGALRM ends the process).
  void abort_all() noexcept {
    alarm(30);
    // The watcher holds the mutex while it asks the communicators for errors: the main thread
    // takes it, so that no communicator is queried while it is aborted (the watcher ends the
    // job after letting it go).
    std::unique_lock<std::mutex> hold(mutex_, std::defer_lock);
    if (std::this_thread::get_id() != watcher_.get_id()) hold.lock();
    // The watcher stops before it queries a communicator again: aborted, they are freed.
    stop_ = true;
    for (auto it = comms_.rbegin(); it != comms_.rend(); ++it) {
      if (const ncclResult_t r = ncclCommAbort(*it); r != ncclSuccess) {
        std::cerr << fmt::format("dtexec: rank {}: ncclCommAbort failed: {}\n", rank_,
                                 ncclGetErrorString(r));
      }
    }
  }

  // Every second: a communicator's asynchronous error (a peer's network failure, a timeout
  // inside NCCL) ends the job instead of leaving this rank waiting.
  void watch() {
    std::string error;
    // (No context on another GPU from this thread.)
    if (const cudaError_t set = cudaSetDevice(gpu_); set != cudaSuccess) {
      error = fmt::format("the NCCL error watcher's cudaSetDevice({}) failed: {}", gpu_,
                          cudaGetErrorString(set));
    }
    if (error.empty()) {
      std::unique_lock<std::mutex> lock(mutex_);
      while (error.empty() &&
             !wake_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_; })) {
        for (ncclComm_t c : comms_) {
          ncclResult_t state = ncclSuccess;
          // A query that fails is an error as well: the watcher would be blind to the rest.
          if (const ncclResult_t asked = ncclCommGetAsyncError(c, &state); asked != ncclSuccess) {
            error = fmt::format("ncclCommGetAsyncError failed: {}", ncclGetErrorString(asked));
            break;
          }
          if (state != ncclSuccess && state != ncclInProgress) {
            error =
                fmt::format("NCCL reported an asynchronous error: {}", ncclGetErrorString(state));
            break;
          }
        }
      }
    }
    if (!error.empty()) end_job(error);
  }

  const cpu::MpiSession& session_;
  std::unique_ptr<Comm> host_;
  Device& device_;
  cudaStream_t compute_;
  double timeout_s_;
  int gpu_;
  int rank_, size_;
  ncclComm_t world_ = nullptr;
  std::vector<ncclComm_t> comms_;    // all of them, the job's first; fixed once built
  std::vector<Channel> groups_;      // per Program group; no communicator where not a member
  std::map<int, Channel> sends_;     // per receiving rank
  std::map<int, ncclComm_t> recvs_;  // per sending rank
  // Receives posted ahead of need, per sending rank (overlapped pipeline transfers: then the
  // pair's communicator is used from this stream only).
  std::map<int, cudaStream_t> recv_streams_;
  std::vector<cudaStream_t> streams_;
  cudaEvent_t fence_ = nullptr;
  std::vector<cudaEvent_t> done_;          // handles of this step: done_[0, used_)
  std::optional<TransferMarks> transfer_;  // since the last take_transfer_marks
  int used_ = 0;
  struct Staged {
    View copy;
    cudaEvent_t sent;  // recorded on the pair's stream after the send
  };
  std::vector<Staged> staged_;  // copies being sent
  std::vector<cudaEvent_t> spare_events_;
  std::thread watcher_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(const cpu::MpiSession& session, const lower::Program& program,
                                     Device& device, double timeout_s) {
  return std::make_unique<NcclComm>(session, program, device, timeout_s);
}

}  // namespace dtsim::exec::cuda
