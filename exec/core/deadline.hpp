// A time limit on blocking calls that have none of their own (header-only, plain C++: the CUDA
// sources include it too).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace dtsim::exec {

// Ends the process with exit code 3 (dtexec's code for a hang), `what` on stderr, if it is not
// destroyed within `seconds` (0 or less: never). For the calls that wait on peers with no time
// limit of their own: setting up NCCL communicators (a peer that failed or cannot be reached
// leaves ncclCommInitRank waiting), the collectives that calibrate times. No MPI call happens on
// its thread; mpirun ends the other ranks once this one has exited.
class Deadline {
 public:
  Deadline(double seconds, std::string what) {
    if (!(seconds > 0)) return;
    thread_ = std::thread([this, seconds, what = std::move(what)] {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!met_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) {
        std::cerr << what << std::endl;
        std::_Exit(3);
      }
    });
  }
  ~Deadline() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    met_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  Deadline(const Deadline&) = delete;
  Deadline& operator=(const Deadline&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable met_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace dtsim::exec
