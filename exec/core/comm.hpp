// What the Program runner needs from a communication backend: the collectives and
// point-to-point transfers of a lowered Program's communication tasks, over the Program's groups,
// plus a few calls outside the Program (reporting losses and times, assembling checkpoints,
// putting the ranks' clocks on one).
//
// The tensors are views of the runner's Device (exec/core/device.hpp), with their type and size
// (counts are elements). A backend moves the memory it can: the MPI backend (exec/cpu/mpi_comm)
// host fp32, a NCCL backend (to come) device memory; moves_device_memory() says which, and the
// runner refuses a pairing that cannot work. Implementations: `SingleRankComm` below (one rank,
// no peers), the MPI backend and, to come, NCCL. Groups are indices into Program::groups; a rank
// only calls collectives of groups it belongs to, and all members call them in the same order.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "exec/core/device.hpp"
#include "sim/common/error.hpp"

namespace dtsim::exec {

enum class Reduce { Sum, Max };

// Each rank's clock less rank 0's, in seconds (on rank 0; empty elsewhere), and a bound on the
// error of each: Comm::clock_offsets.
struct ClockOffsets {
  std::vector<double> offset_s;
  double error_s = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;  // the global rank (the Program's rank index)
  virtual int size() const = 0;
  // Whether the views may be device memory (a GPU's): else host memory only.
  virtual bool moves_device_memory() const { return false; }
  // Whether a started collective moves its data while the rank computes (NCCL, on streams of
  // its own); else only inside this backend's calls, between tasks (exec/core/peer_waits.hpp:
  // leave_out_compute).
  virtual bool progresses_while_computing() const { return true; }

  // Collectives over Program group `group`, in place or with per-member counts (elements).
  virtual void all_reduce(int group, View data, Reduce op) = 0;
  // out = the sum over members of their in[offset(me) .. + counts[me]). In place where `out`
  // is that part of `in` (ZeRO-1 over contiguous buffers, Megatron-LM's distributed
  // optimizer); the rest of `in` is then undefined after it.
  virtual void reduce_scatter(int group, View in, View out, std::span<const int> counts) = 0;
  // out = the concatenation of every member's in (counts[member] elements each). In place
  // where `in` is this member's part of `out`, at its place there.
  virtual void all_gather(int group, View in, View out, std::span<const int> counts) = 0;
  // Expert parallelism's exchange, in member order: in holds one piece per member (in_counts[r]
  // elements for member r, consecutive), out one piece from each member (out_counts[r]
  // elements, consecutive); the counts must match what the other ends send and receive.
  virtual void all_to_all(int group, View in, std::span<const int> in_counts, View out,
                          std::span<const int> out_counts);

  // Non-blocking variants (data-parallel buckets that overlap the rest of the backward pass,
  // ZeRO's weight gathers ahead of the units that read them): the buffers, and the counts,
  // must stay untouched until finish(handle) returns. progress() lets the backend advance them
  // between tasks.
  using Handle = int;
  virtual Handle start_all_reduce(int group, View data) = 0;
  virtual Handle start_reduce_scatter(int group, View in, View out,
                                      std::span<const int> counts) = 0;
  virtual Handle start_all_gather(int group, View in, View out, std::span<const int> counts) = 0;
  virtual void finish(Handle handle) = 0;
  virtual void progress() {}
  // When a started collective or posted receive was first seen complete (by progress() between
  // tasks, else by finish), once finish(handle) has returned: the end of its measured time.
  // Unknown (nullopt) for backends that queue work on a device, timed by device marks instead.
  virtual std::optional<std::chrono::steady_clock::time_point> completed_at(Handle) const {
    return std::nullopt;
  }
  // Whether a started collective is already complete, without waiting: what progress() saw
  // (completed_at), or what a device-queueing backend's event says; finish(handle) then costs
  // nothing.
  virtual bool complete(Handle handle) { return completed_at(handle).has_value(); }

  // A device that queues work (a GPU) runs a started collective or a send on a stream of the
  // backend's own, after the runner's marks around its launch on the device's stream: the
  // device marks (Device::mark's numbering) around what the calls since the last take queued
  // there, the first one's start (once the stream has reached it: the compute before it and the
  // stream's earlier work done) and the last one's end, so that the task is timed as its
  // transfer and not its launch. nullopt where none was queued so (a blocking collective holds
  // the device's stream until it ends: the marks around its launch time it), or where the
  // backend has no device marks (MPI: completed_at).
  struct TransferMarks {
    int start = -1, end = -1;
  };
  virtual std::optional<TransferMarks> take_transfer_marks() { return std::nullopt; }
  // Point-to-point between global ranks. send copies the data and may return before the peer
  // receives it; wait_sends completes every send issued so far.
  virtual void send(int peer, std::int64_t tag, View data) = 0;
  virtual void recv(int peer, std::int64_t tag, View data) = 0;
  // A receive posted ahead of need (plan.overlap_p2p_comm): `data` is written by the time
  // finish(handle) returns and must stay untouched until then.
  virtual Handle start_recv(int peer, std::int64_t tag, View data) = 0;
  virtual void wait_sends() = 0;
  // What follows (the next compute) starts once every send issued so far is received: the
  // sender of a blocking pipeline exchange waits (Megatron-LM: batch_isend_irecv, then wait).
  // A backend without point-to-point peers has nothing to wait for.
  virtual void finish_sends() {}

  // Outside the Program: element-wise over all ranks, result on every rank.
  virtual void all_ranks(std::span<double> data, Reduce op) = 0;
  // Every rank's bytes, on rank 0 (empty elsewhere); taken by value, so that a rank's own part
  // moves rather than copies (a checkpoint's can be gigabytes).
  virtual std::vector<std::string> gather_to_root(std::string mine) = 0;
  virtual void barrier() = 0;
  // Where the ranks' clocks are on different machines: every rank calls it with its clock
  // (seconds), and rank 0 gets each rank's reading less its own at one moment. Rank 0 times
  // round trips to each rank, which answers with its reading; the shortest of several is kept,
  // and its midpoint taken as the moment the rank read (Cristian's method), which is off by
  // half that round trip at most (`error_s`: the largest such half).
  virtual ClockOffsets clock_offsets(const std::function<double()>& now) = 0;
  // On an error that ends the job: aborts the backend's own communicators (NCCL's
  // ncclCommAbort), so that their queued kernels return instead of waiting for this rank, before
  // the launcher ends the ranks (MPI_Abort). Nothing to do where MPI alone carries the data.
  virtual void abort_communicators() noexcept {}
};

// One rank and no peers: collectives over a group of one are the identity (a copy, through
// `device` when one is given: its memory may not be the host's).
class SingleRankComm final : public Comm {
 public:
  explicit SingleRankComm(Device* device = nullptr) : device_(device) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  bool moves_device_memory() const override { return device_ != nullptr; }
  void all_reduce(int, View, Reduce) override {}
  void reduce_scatter(int, View in, View out, std::span<const int>) override { copy(out, in); }
  void all_gather(int, View in, View out, std::span<const int>) override { copy(out, in); }
  void all_to_all(int, View in, std::span<const int>, View out, std::span<const int>) override {
    copy(out, in);
  }
  Handle start_all_reduce(int, View) override { return 0; }
  Handle start_reduce_scatter(int group, View in, View out, std::span<const int> counts) override {
    reduce_scatter(group, in, out, counts);
    return 0;
  }
  Handle start_all_gather(int group, View in, View out, std::span<const int> counts) override {
    all_gather(group, in, out, counts);
    return 0;
  }
  void finish(Handle) override {}
  void send(int, std::int64_t, View) override {
    throw InternalError("a single-rank run has no peer to send to");
  }
  void recv(int, std::int64_t, View) override {
    throw InternalError("a single-rank run has no peer to receive from");
  }
  Handle start_recv(int, std::int64_t, View) override {
    throw InternalError("a single-rank run has no peer to receive from");
  }
  void wait_sends() override {}
  void all_ranks(std::span<double>, Reduce) override {}
  std::vector<std::string> gather_to_root(std::string mine) override {
    std::vector<std::string> out;  // not {std::move(mine)}: an initializer list copies
    out.push_back(std::move(mine));
    return out;
  }
  void barrier() override {}
  ClockOffsets clock_offsets(const std::function<double()>&) override { return {{0.0}, 0.0}; }

 private:
  void copy(View out, View in) {
    DTSIM_ASSERT(in.n == out.n && in.type == out.type, "a collective over one rank");
    if (in.p == out.p) return;  // in place
    if (device_ != nullptr) {
      device_->copy(out, in);
    } else if (!in.empty() && in.p != out.p) {
      std::memmove(out.p, in.p, static_cast<std::size_t>(in.n) * bytes_of(in.type));
    }
  }
  Device* device_;
};

// The shapes of a collective's views, which a backend checks before a library that trusts the
// counts it is given (NCCL reads and writes what they say): `whole` holds every member's count
// in member order, `part` this member's (reduce-scatter: in whole, out part; all-gather: the
// other way round), both of one type.
inline void expect_shapes(const char* collective, View whole, View part,
                          std::span<const int> counts, int member) {
  std::int64_t sum = 0;
  for (int c : counts) sum += c;
  DTSIM_ASSERT(whole.type == part.type && whole.n == sum && member >= 0 &&
                   static_cast<std::size_t>(member) < counts.size() &&
                   part.n == counts[static_cast<std::size_t>(member)],
               std::string(collective) + ": views of " + std::to_string(whole.n) + " and " +
                   std::to_string(part.n) + " elements for counts summing to " +
                   std::to_string(sum) + " (member " + std::to_string(member) + " of " +
                   std::to_string(counts.size()) + ")");
}
// All-to-all: `in` holds the pieces sent, `out` those received, consecutive, of one type.
inline void expect_all_to_all_shapes(View in, std::span<const int> in_counts, View out,
                                     std::span<const int> out_counts) {
  std::int64_t sent = 0, received = 0;
  for (int c : in_counts) sent += c;
  for (int c : out_counts) received += c;
  DTSIM_ASSERT(in.type == out.type && in.n == sent && out.n == received &&
                   in_counts.size() == out_counts.size(),
               "all-to-all: views of " + std::to_string(in.n) + " and " + std::to_string(out.n) +
                   " elements for " + std::to_string(sent) + " sent and " +
                   std::to_string(received) + " received");
}

inline void Comm::all_to_all(int, View, std::span<const int>, View, std::span<const int>) {
  throw UnsupportedError("this communication backend has no all-to-all yet");
}

}  // namespace dtsim::exec
