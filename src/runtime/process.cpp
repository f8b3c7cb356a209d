#include "runtime/process.h"

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

#include "runtime/host_hooks.h"
#include "runtime/quiet_fork.h"

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
  // The codes runChild() below exits with when the child's own code never ran or failed.
  switch (exit_status) {
    case kExitSetUpFailed:
      return fmt::format("exited with status {}: its set-up failed (the reason is in its error)",
                         exit_status);
    case kExitParentLost:
      return fmt::format("exited with status {}: its parent was gone", exit_status);
    case kExitParentGone:
      return fmt::format(
          "exited with status {}: it could not start (its parent was gone, or "
          "prctl(PR_SET_PDEATHSIG) failed)",
          exit_status);
    case kExitThrew:
      return fmt::format(
          "exited with status {}: it failed with an error (printed on its "
          "stderr)",
          exit_status);
    case kExitNoThread:
      return fmt::format(
          "exited with status {}: it could not start a thread (a process or "
          "thread limit such as ulimit -u / RLIMIT_NPROC, or no memory)",
          exit_status);
    default:
      return fmt::format("exited with status {}", exit_status);
  }
}

namespace {
// PR_SET_PDEATHSIG signals the child when the *thread* that forked it ends (a
// std::thread, a Python threading.Thread or a pool task that made the
// Aggregator), and again when the thread it is handed to ends, up to the
// process. So the signal is one the child handles: it dies only when its
// parent process is gone (getppid() is the process, not the thread).
pid_t g_parent = 0;
void onParentThreadEnd(int) {
  if (::getppid() != g_parent) ::kill(::getpid(), SIGKILL);
}
int parentDeathSignal() { return SIGRTMAX - 1; }

bool armParentDeath(pid_t parent) {
  g_parent = parent;
  struct sigaction action {};
  action.sa_handler = onParentThreadEnd;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  if (::sigaction(parentDeathSignal(), &action, nullptr) != 0) return false;
  return ::prctl(PR_SET_PDEATHSIG, parentDeathSignal()) == 0;
}

// In the child: never returns into the parent's code, never runs its atexit handlers.
[[noreturn]] void runChild(pid_t parent, const std::function<int()>& body) noexcept {
  int code = kExitParentGone;
  const HostHooks& hooks = hostHooks();
  if (hooks.after_fork_child) hooks.after_fork_child();
  if (!armParentDeath(parent) || ::getppid() != parent) ::_exit(code);
  std::signal(SIGINT, SIG_IGN);
  try {
    std::thread([&] {
      try {
        code = body();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "gradagg: child process %d failed: %s\n", ::getpid(), e.what());
        code = kExitThrew;
      } catch (...) {
        code = kExitThrew;
      }
    }).join();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gradagg: child process %d could not start its thread: %s\n", ::getpid(),
                 e.what());
    code = kExitNoThread;
  }
  try {
    if (hooks.before_child_exit) hooks.before_child_exit();
  } catch (...) {
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(code);
}

pid_t forkChild(const std::function<int()>& body) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  const HostHooks& hooks = hostHooks();
  if (hooks.before_fork) hooks.before_fork();
  settleOtherThreads(std::chrono::milliseconds(50));  // runtime/quiet_fork.h
  const pid_t pid = ::fork();
  if (pid == 0) runChild(parent, body);
  const int fork_errno = errno;
  if (hooks.after_fork_parent) hooks.after_fork_parent();
  if (pid < 0)
    throw fmt::system_error(
        fork_errno, "gradagg: fork failed{}",
        fork_errno == EAGAIN ? " (a process limit such as ulimit -u / RLIMIT_NPROC, or no memory)"
                             : "");
  return pid;
}
}  // namespace

pid_t ProcessSet::spawn(const std::function<int()>& body) {
  children_.reserve(children_.size() + 1);  // no allocation after fork in the parent
  const pid_t pid = forkChild(body);
  children_.push_back(Child{pid, std::nullopt});
  return pid;
}

pid_t ProcessSet::respawn(std::size_t i, const std::function<int()>& body) {
  Child& c = children_.at(i);
  if (!c.exit) {
    ::kill(c.pid, SIGKILL);
    int status = 0;
    const pid_t r = [&] {
      pid_t got;
      while ((got = ::waitpid(c.pid, &status, 0)) < 0 && errno == EINTR) {
      }
      return got;
    }();
    // Reaped: should the fork below fail, this pid is never signalled again.
    c.exit = r == c.pid ? fromWaitStatus(status) : ProcessExit{};
  }
  c = Child{forkChild(body), std::nullopt};
  return c.pid;
}

std::vector<int> ProcessSet::pids() const {
  std::vector<int> out;
  for (const Child& c : children_) out.push_back(c.pid);
  return out;
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
  if (forkedCopy()) {
    children_.clear();
    return;
  }
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
