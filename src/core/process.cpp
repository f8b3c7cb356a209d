#include "core/process.h"

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <thread>

#include <fmt/format.h>
#include <fmt/os.h>

namespace gradagg::detail {

namespace {
ProcessExit fromWaitStatus(int status) {
  ProcessExit e;
  if (WIFEXITED(status)) {
    e.exit_status = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    e.signal = WTERMSIG(status);
  }
  return e;
}
}  // namespace

std::string ProcessExit::describe() const {
  if (signal != 0) return fmt::format("was killed by signal {} ({})", signal, ::strsignal(signal));
  return fmt::format("exited with status {}", exit_status);
}

pid_t ProcessSet::spawn(const std::function<int()>& body) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  children_.reserve(children_.size() + 1);  // no allocation after fork in the parent
  const pid_t pid = ::fork();
  if (pid < 0) throw fmt::system_error(errno, "gradagg: fork");
  if (pid == 0) {
    // The child: never return into the parent's code, never run its atexit handlers.
    int code = 125;
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(code);
    std::signal(SIGINT, SIG_IGN);
    try {
      code = body();
    } catch (...) {
      code = 126;
    }
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);
    ::_exit(code);
  }
  children_.push_back(Child{pid, std::nullopt});
  return pid;
}

std::optional<ProcessExit> ProcessSet::poll(std::size_t i) {
  Child& c = children_[i];
  if (c.exit) return c.exit;
  int status = 0;
  const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
  if (r == c.pid) {
    c.exit = fromWaitStatus(status);
  } else if (r < 0 && errno == ECHILD) {
    c.exit = ProcessExit{};  // reaped by someone else (a SIGCHLD handler): treat as gone
  }
  return c.exit;
}

bool ProcessSet::waitAll(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    bool all = true;
    for (std::size_t i = 0; i < children_.size(); ++i) all = poll(i).has_value() && all;
    if (all) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void ProcessSet::killAll() noexcept {
  for (Child& c : children_) {
    if (c.exit) continue;
    ::kill(c.pid, SIGKILL);
  }
  for (Child& c : children_) {
    if (c.exit) continue;
    int status = 0;
    pid_t r;
    do {
      r = ::waitpid(c.pid, &status, 0);
    } while (r < 0 && errno == EINTR);
    c.exit = r == c.pid ? fromWaitStatus(status) : ProcessExit{};
  }
}

}  // namespace gradagg::detail
