// ProcessSet: the parent's worker processes, forked once. The destructor kills
// and reaps whatever still runs, so an exception or a failing test never leaks one.
#pragma once

#include <unistd.h>

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace gradagg::detail {

// Exit codes of a child (describe() explains them). Its own code's:
constexpr int kExitSetUpFailed = 3;  // its set-up failed; it told the parent why, then exited
constexpr int kExitParentLost = 4;   // its parent died while it served
// A child whose own code never ran or failed:
constexpr int kExitParentGone = 125;  // the parent died before the child was set up
constexpr int kExitThrew = 126;       // the child's body threw
constexpr int kExitNoThread = 127;    // no thread could be started in the child

struct ProcessExit {
  int exit_status = -1;          // when it exited; -1 when killed by a signal
  int signal = 0;                // when killed by a signal
  std::string describe() const;  // "exited with status 3" / "was killed by signal 9 (Killed)"
};

class ProcessSet {
 public:
  ProcessSet() = default;
  ProcessSet(const ProcessSet&) = delete;
  ProcessSet& operator=(const ProcessSet&) = delete;
  ~ProcessSet() { killAll(); }

  // Forks a child that arms PR_SET_PDEATHSIG (with a handler that kills the
  // child with SIGKILL once the parent *process* is gone: the signal also comes
  // when only the thread that forked it ends, and the workers outlive that
  // thread), checks its parent is still the one that forked it, ignores
  // SIGINT (the parent decides), runs
  // body() on a fresh thread and _exits with its result (126, and the message
  // on stderr, when it throws). Returns the child's pid in the parent; never
  // returns in the child. Flushes stdio first so nothing is printed twice.
  // The fresh thread: libgomp's pool state inherited from a parent that already
  // ran parallel regions hangs the forked main thread's next parallel region,
  // while a new thread builds a new pool.
  pid_t spawn(const std::function<int()>& body);
  // Kills and reaps child i, then forks `body` in its place (same index).
  pid_t respawn(std::size_t i, const std::function<int()>& body);

  std::size_t size() const noexcept { return children_.size(); }
  pid_t pid(std::size_t i) const { return children_[i].pid; }
  // Every child's pid, by index.
  std::vector<int> pids() const;

  // Non-blocking: how child i ended, or nothing while it runs.
  std::optional<ProcessExit> poll(std::size_t i);
  // Waits until every child has ended or `timeout` passed; true when all ended.
  bool waitAll(std::chrono::milliseconds timeout);
  // SIGKILL every child still running, then reap it. Idempotent. In a copy
  // made by fork() (forkedCopy()) it only forgets them: they are the owner's.
  void killAll() noexcept;
  // Forgets every child; call after killAll().
  void clear() noexcept { children_.clear(); }
  // This object was copied into another process by a fork() (the user's, or a
  // Python os.fork()): the children belong to the process that made them.
  bool forkedCopy() const noexcept { return ::getpid() != owner_; }
  pid_t owner() const noexcept { return owner_; }

 private:
  struct Child {
    pid_t pid = -1;
    std::optional<ProcessExit> exit;  // set once reaped
  };
  std::vector<Child> children_;
  pid_t owner_ = ::getpid();  // the process whose children these are
};

}  // namespace gradagg::detail
