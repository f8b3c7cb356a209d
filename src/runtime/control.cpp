#include "runtime/control.h"

#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>

#include "runtime/check.h"
#include "runtime/host_hooks.h"
#include "runtime/sync.h"

namespace gradagg::detail {

namespace {
// Spin this long before blocking: covers the parent's optimizer step between
// two steps of a small model, and a peer finishing its backward a little later.
const std::chrono::nanoseconds kSpin = spinBudget(std::chrono::microseconds(200));
// The parent's spin when it has a core of its own (ParentChannel::setOwnCore):
// a step of a few ms (Fashion-MNIST's 784-64-10 at batch 32: 1.6 ms) is waited
// for without sleeping; longer ones sleep after it.
const std::chrono::nanoseconds kOwnCoreSpin = spinBudget(std::chrono::milliseconds(5));
// How often the parent checks its workers, and a worker its parent, while blocked.
constexpr auto kLivenessSlice = std::chrono::milliseconds(50);
// A slice that took this much longer than asked means nobody could run: the job
// was stopped (Ctrl-Z, SIGSTOP to the group) or the machine paused. That time
// does not count against a deadline: suspension is not a failure.
constexpr auto kSuspendedGap = std::chrono::seconds(1);
constexpr auto kParentCheck = std::chrono::milliseconds(100);
}  // namespace

std::chrono::nanoseconds SpinPolicy::budget() const noexcept {
  return average_ns_ <= 2.0 * static_cast<double>(kSpin.count()) ? kSpin
                                                                 : std::chrono::nanoseconds(0);
}

void SpinPolicy::record(Clock::duration waited) noexcept {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count();
  average_ns_ += (static_cast<double>(ns) - average_ns_) / 8;
}

std::string Awaited::describe() const {
  std::string out = number >= 0 ? fmt::format("{} {}", name, number) : std::string(name);
  if (detail != nullptr && detail[0] != '\0') out += fmt::format(" ({})", detail);
  return out;
}

// ---- parent ---------------------------------------------------------------

ParentChannel::ParentChannel(std::atomic<std::uint32_t>& command_seq,
                             std::vector<WorkerWords> workers, ProcessSet& processes,
                             ChannelNames names)
    : command_seq_(&command_seq),
      workers_(std::move(workers)),
      processes_(&processes),
      names_(names),
      seq_(command_seq.load(std::memory_order_relaxed)) {}

Phase ParentChannel::phaseOf(int rank) const noexcept {
  return static_cast<Phase>(workers_[rank].phase->load(std::memory_order_relaxed));
}

bool ParentChannel::done(int rank) const noexcept {
  return workers_[rank].done_seq->load(std::memory_order_acquire) == seq_;
}

namespace {
void setLines(std::initializer_list<ArriveLine> lines, int workers) {
  for (const ArriveLine& line : lines)
    line.word->store(static_cast<std::uint32_t>(workers) + (line.closed ? 1 : 0),
                     std::memory_order_relaxed);
}
}  // namespace

void ParentChannel::prepareStart(std::initializer_list<ArriveLine> lines) {
  seq_ = command_seq_->load(std::memory_order_relaxed);
  beginRound();
  for (int r = 0; r < workers(); ++r) {
    workers_[r].done_seq->store(seq_ - 1, std::memory_order_relaxed);  // "not arrived"
    prepareRestart(r);
  }
  setLines(lines, workers());
}

void ParentChannel::prepareRestart(int rank) {
  workers_[rank].phase->store(static_cast<std::uint32_t>(Phase::kStarting),
                              std::memory_order_relaxed);
}

void ParentChannel::command(std::initializer_list<ArriveLine> lines) {
  setLines(lines, workers());
  seq_ = command_seq_->fetch_add(1, std::memory_order_release) + 1;
  futexWakeAll(*command_seq_);
  beginRound();
}

void ParentChannel::beginRound() noexcept {
  stopped_ = {};
  last_look_ = Clock::now();
}

void ParentChannel::await(const std::atomic<std::uint32_t>& line, std::chrono::milliseconds timeout,
                          const Awaited& what, Clock::time_point since) {
  const auto begin = Clock::now();
  // Since the command's last look: its own work between two waits (a bucket's
  // sum) takes far less than kSuspendedGap; more means this process was stopped.
  if (begin - last_look_ > kSuspendedGap) stopped_ += begin - last_look_;
  last_look_ = begin;
  spinUntilEqual(line, 0, own_core_ ? kOwnCoreSpin : spin_.budget());
  for (;;) {
    const std::uint32_t left = line.load(std::memory_order_acquire);
    const auto now = Clock::now();
    // A look that came a slice and a second after the last one: we were stopped
    // (also during the spin), not the workers late.
    const auto gap = now - last_look_ - kLivenessSlice;
    if (gap > kSuspendedGap) stopped_ += gap;
    last_look_ = now;
    if (left == 0) {
      spin_.record(now - begin);
      return;
    }
    checkAlive(what);
    checkInterrupt(what);
    const auto deadline = since + timeout + stopped_;
    if (now >= deadline) {
      const int k = lateRank();
      // Every worker done but `line` not yet 0: the last one's arrival is a
      // moment away (it marks itself done first). Not a timeout; wait for it.
      if (k < 0 && now < deadline + kLivenessSlice) {
        futexWait(line, left, kLivenessSlice);
        continue;
      }
      GRADAGG_ENFORCE(k >= 0, "deadline passed but every {} is done", names_.worker);
      fail<StepTimeout>(k, fmt::format("gradagg: {} {} did not finish {} within {} ms (it is in "
                                       "phase '{}'); the {} were stopped",
                                       names_.worker, k, what.describe(), timeout.count(),
                                       phaseName(phaseOf(k)), names_.workers));
    }
    futexWait(line, left, std::min<Clock::duration>(kLivenessSlice, deadline - now));
  }
}

void ParentChannel::checkAlive(const Awaited& what) {
  for (int k = 0; k < workers(); ++k) {
    const auto exit = processes_->poll(static_cast<std::size_t>(k));
    if (!exit) continue;
    if (on_death_ && on_death_(k, *exit)) continue;
    const Phase phase = phaseOf(k);
    const std::string msg =
        fmt::format("gradagg: {} {} (pid {}) {} in phase '{}' during {}; the other {} were stopped",
                    names_.worker, k, processes_->pid(static_cast<std::size_t>(k)),
                    exit->describe(), phaseName(phase), what.describe(), names_.workers);
    stop(msg);
    throw WorkerDied(msg, k, phase, exit->exit_status, exit->signal);
  }
}

void ParentChannel::checkInterrupt(const Awaited& what) {
  const HostHooks& hooks = hostHooks();
  if (!hooks.check_interrupt) return;
  try {
    hooks.check_interrupt();
  } catch (...) {
    stop(fmt::format("it was interrupted during {}; the {} were stopped", what.describe(),
                     names_.workers));
    throw;
  }
}

// The worker to blame for a missed deadline: the first that has not finished
// and is not waiting for its peers (they wait for it), else the first not
// done; -1 when every worker is done.
int ParentChannel::lateRank() const {
  int not_done = -1;
  for (int k = 0; k < workers(); ++k) {
    if (done(k)) continue;
    if (!names_.peer_wait_phase || phaseOf(k) != *names_.peer_wait_phase) return k;
    if (not_done < 0) not_done = k;
  }
  return not_done;
}

std::string ParentChannel::unusableReason() const {
  if (forkedCopy())
    return fmt::format(
        "this is a copy made by fork() in process {}: the workers belong to process {}, which "
        "alone can use or stop them",
        ::getpid(), processes_->owner());
  return reason_;
}

void ParentChannel::stop(const std::string& reason) noexcept {
  processes_->killAll();  // in a forked copy: forgets them, touches nothing
  if (usable_) {
    try {
      reason_ = reason;
    } catch (...) {
    }
  }
  usable_ = false;
}

void ParentChannel::shutdown(const std::function<void()>& stop_command,
                             std::chrono::milliseconds grace) noexcept {
  if (processes_ == nullptr) return;
  if (usable()) {  // not in a forked copy: the stop command would reach the owner's workers
    try {
      stop_command();
      processes_->waitAll(grace);
    } catch (...) {
    }
  }
  stop("it was shut down");
}

// ---- worker ---------------------------------------------------------------

WorkerChannel::WorkerChannel(std::atomic<std::uint32_t>& command_seq, WorkerWords self,
                             pid_t parent)
    : command_seq_(command_seq), self_(self), parent_(parent) {}

std::optional<std::uint32_t> WorkerChannel::awaitCommand(std::uint32_t seen) {
  setPhase(Phase::kWaiting);
  const auto begin = Clock::now();
  std::uint32_t v = spinWhileEqual(command_seq_, seen, command_spin_.budget());
  while (v == seen) {
    futexWait(command_seq_, seen, kParentCheck);
    v = command_seq_.load(std::memory_order_acquire);
    if (v == seen && ::getppid() != parent_) return std::nullopt;
  }
  command_spin_.record(Clock::now() - begin);
  return v;
}

bool WorkerChannel::awaitZero(const std::atomic<std::uint32_t>& line) {
  const auto begin = Clock::now();
  std::uint32_t v = spinUntilEqual(line, 0, line_spin_.budget());
  while (v != 0) {
    futexWait(line, v, kParentCheck);
    v = line.load(std::memory_order_acquire);
    if (v != 0 && ::getppid() != parent_) return false;
  }
  line_spin_.record(Clock::now() - begin);
  return true;
}

std::uint32_t WorkerChannel::arrive(std::atomic<std::uint32_t>& line) const {
  const std::uint32_t left = line.fetch_sub(1, std::memory_order_acq_rel) - 1;
  if (left == 0) futexWakeAll(line);
  return left;
}

void WorkerChannel::finish(std::atomic<std::uint32_t>& line, std::uint32_t seq) {
  setPhase(Phase::kWaiting);
  self_.done_seq->store(seq, std::memory_order_release);
  arrive(line);
}

}  // namespace gradagg::detail
