#include "sim/cli/isolated.hpp"

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>

#include "sim/common/error.hpp"

namespace dtsim::cli {

std::string error_kind(const std::exception& e) {
  if (dynamic_cast<const InputError*>(&e)) return "input";
  if (dynamic_cast<const UnsupportedError*>(&e)) return "unsupported";
  return "internal";
}

[[noreturn]] void rethrow_error(const std::string& kind, const std::string& what) {
  if (kind == "input") throw InputError(what);
  if (kind == "unsupported") throw UnsupportedError(what);
  throw InternalError(what);
}

std::string run_isolated(const std::function<std::string()>& work) {
  int fds[2];
  if (pipe(fds) != 0) throw InternalError(fmt::format("pipe: {}", std::strerror(errno)));
  // (What is buffered would be written twice, by each process.)
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(fds[0]);
    close(fds[1]);
    throw InternalError(fmt::format("fork: {}", std::strerror(err)));
  }
  if (pid == 0) {
    close(fds[0]);
    std::string out;
    try {
      out = "ok\n" + work();
    } catch (const std::exception& e) {
      out = error_kind(e) + "\n" + e.what();
    } catch (...) {
      out = "internal\nan exception of no known type";
    }
    for (std::size_t at = 0; at < out.size();) {
      const ssize_t n = write(fds[1], out.data() + at, out.size() - at);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) _exit(3);
      at += static_cast<std::size_t>(n);
    }
    close(fds[1]);
    // Without the parent's exit handlers and buffers: they are the parent's to run.
    _exit(0);
  }
  close(fds[1]);
  std::string in;
  char buf[65536];
  for (;;) {
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    in.append(buf, static_cast<std::size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) {
    throw InternalError(fmt::format("a child process (pid {}) was killed by signal {} ({})", pid,
                                    WTERMSIG(status), strsignal(WTERMSIG(status))));
  }
  const std::size_t eol = in.find('\n');
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || eol == std::string::npos) {
    throw InternalError(
        fmt::format("a child process (pid {}) ended with exit code {} before "
                    "it had returned its result",
                    pid, WIFEXITED(status) ? WEXITSTATUS(status) : -1));
  }
  const std::string kind = in.substr(0, eol);
  std::string rest = in.substr(eol + 1);
  if (kind == "ok") return rest;
  rethrow_error(kind, rest);
}

}  // namespace dtsim::cli
