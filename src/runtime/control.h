// The control channel: how a parent drives the workers it forked, one command
// at a time, and how each worker answers. Written once; the aggregator and its
// workers, the population and its members use it.
//
// The words live in the segment of the mode that uses it (its layout.h says
// where); the channel only holds their addresses:
//   command_seq   the parent writes a command's fields, then bumps command_seq
//                 (release) and wakes; a worker waits until it moves past the
//                 last command it served, then reads the fields (acquire).
//   arrive lines  counters the parent sets to N before it bumps command_seq
//                 (and before it forks, for start-up); each worker takes one
//                 from a line once (acq_rel) when its part is done; the one that
//                 takes the last wakes everyone waiting on the line.
//   phase[r]      where worker r is (relaxed), named in errors.
//   done_seq[r]   the command worker r last finished, stored (release) just
//                 before its last arrival of that command; names the late ones.
// Every wait spins briefly, then sleeps in bounded futex slices. The parent
// checks each slice that every worker lives and that its deadline has not
// passed; a worker checks that its parent lives. A failure is blamed on one
// worker by rank and phase, stops every worker and leaves the owner unusable.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <sys/types.h>

#include <gradagg/errors.h>

#include "runtime/process.h"
#include "runtime/sync.h"

namespace gradagg::detail {

// How long a wait spins before it blocks. It spins (up to the budget) while
// its rounds are short (a moving average of the last few within twice the
// budget), and blocks at once while they are long: then spinning only takes a
// core from the processes it waits for (on a machine with fewer cores than
// processes), and a futex wake-up costs little next to the round.
class SpinPolicy {
 public:
  std::chrono::nanoseconds budget() const noexcept;
  void record(Clock::duration waited) noexcept;

 private:
  double average_ns_ = 0;
};

// One worker's words, wherever its mode keeps them.
struct WorkerWords {
  std::atomic<std::uint32_t>* phase = nullptr;
  std::atomic<std::uint32_t>* done_seq = nullptr;
};

// An arrive line and what the parent sets it to before a command: one per
// worker, and one more for a closed line. On a closed line the worker that
// takes the N-th (arrive() returns 1) is the closer: it sees every other
// worker's writes, does the work that needs them all once, then takes the last.
struct ArriveLine {
  std::atomic<std::uint32_t>* word = nullptr;
  bool closed = false;
};

// What the parent waits for, in words, for errors only ("step 3", "start-up",
// "generation 2 (exploit, explore)"): plain data, so a wait allocates nothing.
struct Awaited {
  const char* name = "start-up";
  std::int64_t number = -1;  // < 0: none
  const char* detail = "";   // appended in parentheses when not empty
  std::string describe() const;
};

// How the channel names the workers in messages, and which of their phases
// means "waiting for its peers" (a worker there is not the one to blame for a
// missed deadline while another has not reached it).
struct ChannelNames {
  const char* worker = "worker";    // "worker 2 (pid 123) was killed ..."
  const char* workers = "workers";  // "... the other workers were stopped"
  std::optional<Phase> peer_wait_phase;
};

class ParentChannel {
 public:
  // What to do about a dead worker before it is an error: return true when it
  // was handled (e.g. a member forked again) and the wait goes on.
  using DeathHandler = std::function<bool(int rank, const ProcessExit& exit)>;

  ParentChannel() = default;
  ParentChannel(std::atomic<std::uint32_t>& command_seq, std::vector<WorkerWords> workers,
                ProcessSet& processes, ChannelNames names);

  int workers() const noexcept { return static_cast<int>(workers_.size()); }
  std::uint32_t seq() const noexcept { return seq_; }
  Phase phaseOf(int rank) const noexcept;
  // False in a copy made by fork() too: the workers are the owner's.
  bool usable() const noexcept { return usable_ && !forkedCopy(); }
  std::string unusableReason() const;
  void onDeath(DeathHandler handler) { on_death_ = std::move(handler); }
  // The parent has a core that none of the processes it waits for needs (its
  // workers' threads and the parents on these cores fit the cores): its waits
  // then spin for up to a few milliseconds whatever the rounds' length, since a
  // futex wake-up (~0.1 ms) is a large part of a small step and spinning there
  // takes nothing from the workers.
  void setOwnCore(bool own) noexcept { own_core_ = own; }

  // Before forking a group: every worker "not arrived" and starting, each of
  // `lines` set to N. The workers start from seq() and arrive for it.
  void prepareStart(std::initializer_list<ArriveLine> lines);
  // Worker `rank` alone is forked again (phase kStarting; done_seq stays, so a
  // worker that arrived before it died is not waited for twice).
  void prepareRestart(int rank);
  // The workers arrived for start-up: the owner is usable.
  void started() noexcept { usable_ = true; }

  // Issues a command whose fields the caller wrote: sets each of `lines` to N
  // (N + 1 when closed), bumps command_seq (release), wakes the workers.
  void command(std::initializer_list<ArriveLine> lines);
  // Waits until `line` reads 0, until `timeout` after `since` (several waits of
  // one command share a deadline), checking every slice that each worker
  // lives. A death is WorkerDied, a missed deadline StepTimeout naming the late
  // worker; both go through fail(). Time this process was stopped (SIGSTOP,
  // Ctrl-Z, a paused machine: a slice that took a second longer than asked)
  // moves the deadline, in this wait or earlier ones of the same command, or
  // between two of them.
  void await(const std::atomic<std::uint32_t>& line, std::chrono::milliseconds timeout,
             const Awaited& what, Clock::time_point since = Clock::now());
  // Did worker `rank` finish the current command (done_seq == seq())?
  bool done(int rank) const noexcept;

  // The failure policy: stops every worker, marks the owner unusable with
  // `what` as the reason, throws E(what, rank, its phase, extra...).
  template <typename E, typename... Extra>
  [[noreturn]] void fail(int rank, const std::string& what, Extra&&... extra) {
    const Phase phase = phaseOf(rank);
    stop(what);
    throw E(what, rank, phase, std::forward<Extra>(extra)...);
  }
  // Stops every worker and marks the owner unusable (idempotent).
  void stop(const std::string& reason) noexcept;
  // The orderly end: `stop_command` (which issues the stop command) when
  // usable, a grace period for the workers to exit, then kill what remains.
  void shutdown(const std::function<void()>& stop_command,
                std::chrono::milliseconds grace) noexcept;

 private:
  // A command (or start-up) begins: no stop credited yet, looked just now.
  void beginRound() noexcept;
  void checkAlive(const Awaited& what);
  // HostHooks::check_interrupt; stops the workers before letting its exception through.
  void checkInterrupt(const Awaited& what);
  int lateRank() const;

  std::atomic<std::uint32_t>* command_seq_ = nullptr;
  std::vector<WorkerWords> workers_;
  bool forkedCopy() const noexcept { return processes_ != nullptr && processes_->forkedCopy(); }

  ProcessSet* processes_ = nullptr;
  ChannelNames names_;
  DeathHandler on_death_;
  SpinPolicy spin_;
  bool own_core_ = false;
  std::uint32_t seq_ = 0;  // the command_seq of the last command
  // The last command's (or start-up's) waits: the stops credited so far, and
  // when a wait of it last looked (a stop between two waits shows as a gap).
  Clock::duration stopped_{};
  Clock::time_point last_look_ = Clock::now();
  bool usable_ = false;
  std::string reason_;
};

class WorkerChannel {
 public:
  WorkerChannel(std::atomic<std::uint32_t>& command_seq, WorkerWords self, pid_t parent);

  // Phase kWaiting, then waits for the command after `seen`: its seq, or
  // nothing when the parent died.
  std::optional<std::uint32_t> awaitCommand(std::uint32_t seen);
  // Waits until `line` reads 0; false when the parent died.
  bool awaitZero(const std::atomic<std::uint32_t>& line);
  // Takes one from `line` and returns how many are left; the worker that took
  // the last one (0 left) has woken the waiters.
  std::uint32_t arrive(std::atomic<std::uint32_t>& line) const;
  // The last arrival of command `seq`: phase kWaiting, done_seq = seq, arrive.
  void finish(std::atomic<std::uint32_t>& line, std::uint32_t seq);
  void setPhase(Phase p) {
    self_.phase->store(static_cast<std::uint32_t>(p), std::memory_order_relaxed);
  }

 private:
  std::atomic<std::uint32_t>& command_seq_;
  WorkerWords self_;
  pid_t parent_;
  SpinPolicy command_spin_, line_spin_;
};

}  // namespace gradagg::detail
