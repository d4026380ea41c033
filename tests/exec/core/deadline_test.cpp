#include "exec/core/deadline.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "tests/test_util.hpp"

namespace {

struct Ended {
  int exit_code = -1;  // -1: not a normal exit
  std::string stderr_text;
};

// Runs `body` in a child process (a Deadline that expires ends its process) and returns how
// the child ended and what it wrote to stderr.
template <typename Body>
Ended in_child(Body body) {
  int pipe_fds[2];
  REQUIRE(pipe(pipe_fds) == 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(pipe_fds[0]);
    dup2(pipe_fds[1], STDERR_FILENO);
    body();
    std::_Exit(0);
  }
  close(pipe_fds[1]);
  Ended ended;
  char buffer[256];
  for (ssize_t n; (n = read(pipe_fds[0], buffer, sizeof buffer)) > 0;) {
    ended.stderr_text.append(buffer, static_cast<std::size_t>(n));
  }
  close(pipe_fds[0]);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  if (WIFEXITED(status)) ended.exit_code = WEXITSTATUS(status);
  return ended;
}

}  // namespace

TEST_CASE("Deadline: a call that outlasts it ends the process with exit code 3 and its message",
          "[exec][deadline]") {
  const Ended ended = in_child([] {
    const dtsim::exec::Deadline deadline(0.05, "the all_reduce of 4096 bytes hung");
    std::this_thread::sleep_for(std::chrono::seconds(5));  // a peer that never answers
  });
  CHECK(ended.exit_code == 3);
  CHECK(ended.stderr_text == "the all_reduce of 4096 bytes hung\n");
}

TEST_CASE("Deadline: met in time, or of 0 s (no limit), it ends nothing", "[exec][deadline]") {
  const Ended met = in_child([] {
    const dtsim::exec::Deadline deadline(30, "hung");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  });
  CHECK(met.exit_code == 0);
  CHECK(met.stderr_text.empty());
  const Ended none = in_child([] {
    const dtsim::exec::Deadline deadline(0, "hung");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  });
  CHECK(none.exit_code == 0);
  CHECK(none.stderr_text.empty());
}
