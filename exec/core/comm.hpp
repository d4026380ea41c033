// What the Program runner needs from a communication backend: the collectives and
// point-to-point transfers of a lowered Program's communication tasks, over the Program's groups,
// plus a few calls outside the Program (reporting losses and times, assembling checkpoints).
//
// Implementations: `SingleRankComm` below (one rank, no peers), the MPI backend
// (exec/cpu/mpi_comm.hpp) and, to come, NCCL. Groups are indices into Program::groups; a rank
// only calls collectives of groups it belongs to, and all members call them in the same order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sim/common/error.hpp"

namespace dtsim::exec {

enum class Reduce { Sum, Max };

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;  // the global rank (the Program's rank index)
  virtual int size() const = 0;

  // Collectives over Program group `group`, in place or with per-member counts (in floats).
  virtual void all_reduce(int group, std::span<float> data, Reduce op) = 0;
  // out = the sum over members of their in[offset(me) .. + counts[me]).
  virtual void reduce_scatter(int group, std::span<const float> in, std::span<float> out,
                              std::span<const int> counts) = 0;
  // out = the concatenation of every member's in (counts[member] floats each).
  virtual void all_gather(int group, std::span<const float> in, std::span<float> out,
                          std::span<const int> counts) = 0;

  // Non-blocking variants (data-parallel buckets that overlap the rest of the backward pass):
  // the buffers must stay untouched until finish(handle) returns. progress() lets the backend
  // advance them between tasks.
  using Handle = int;
  virtual Handle start_all_reduce(int group, std::span<float> data) = 0;
  virtual Handle start_reduce_scatter(int group, std::span<const float> in, std::span<float> out,
                                      std::span<const int> counts) = 0;
  virtual void finish(Handle handle) = 0;
  virtual void progress() {}

  // Point-to-point between global ranks. send copies the data and may return before the peer
  // receives it; wait_sends completes every send issued so far.
  virtual void send(int peer, std::int64_t tag, std::span<const float> data) = 0;
  virtual void recv(int peer, std::int64_t tag, std::span<float> data) = 0;
  virtual void wait_sends() = 0;

  // Outside the Program: element-wise over all ranks, result on every rank.
  virtual void all_ranks(std::span<double> data, Reduce op) = 0;
  // Every rank's bytes, on rank 0 (empty elsewhere).
  virtual std::vector<std::string> gather_to_root(const std::string& mine) = 0;
  virtual void barrier() = 0;
};

// One rank and no peers: collectives over a group of one are the identity.
class SingleRankComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce(int, std::span<float>, Reduce) override {}
  void reduce_scatter(int, std::span<const float> in, std::span<float> out,
                      std::span<const int>) override {
    DTSIM_ASSERT(in.size() == out.size(), "reduce-scatter over one rank");
    std::copy(in.begin(), in.end(), out.begin());
  }
  void all_gather(int, std::span<const float> in, std::span<float> out,
                  std::span<const int>) override {
    DTSIM_ASSERT(in.size() == out.size(), "all-gather over one rank");
    std::copy(in.begin(), in.end(), out.begin());
  }
  Handle start_all_reduce(int, std::span<float>) override { return 0; }
  Handle start_reduce_scatter(int group, std::span<const float> in, std::span<float> out,
                              std::span<const int> counts) override {
    reduce_scatter(group, in, out, counts);
    return 0;
  }
  void finish(Handle) override {}
  void send(int, std::int64_t, std::span<const float>) override {
    throw InternalError("a single-rank run has no peer to send to");
  }
  void recv(int, std::int64_t, std::span<float>) override {
    throw InternalError("a single-rank run has no peer to receive from");
  }
  void wait_sends() override {}
  void all_ranks(std::span<double>, Reduce) override {}
  std::vector<std::string> gather_to_root(const std::string& mine) override { return {mine}; }
  void barrier() override {}
};

}  // namespace dtsim::exec
