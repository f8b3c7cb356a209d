// Errors raised by gradagg. Two kinds, as in gloo:
//  - recoverable, typed errors for users, all derived from gradagg::Error;
//  - broken invariants (bugs), raised as gradagg::InternalError with file and line.
// Operating-system failures are std::system_error (fmt::system_error) and keep errno.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace gradagg {

// Where a worker is. Written by the worker as it moves; named in errors.
enum class Phase : std::uint32_t {
  // Both modes:
  kStarting,  // forked, setting up its replica
  kWaiting,   // idle, waiting for the parent's next command
  // The aggregator's workers:
  kLoadingSnapshot,  // copying the parent's buffers, clearing its slot
  kShard,            // running the user's shard function (forward, loss)
  kBackward,         // autograd writing gradients into its slot
  kWritingSlot,      // checking gradients, writing sample count, loss, buffers
  kReducing,         // summing a range of the gradient over all slots
  kStopping,         // told to exit (both modes)
  // Population mode (a member's phases; it never loads a shared snapshot):
  kTraining,    // running train_step
  kScoring,     // running score
  kPublishing,  // writing a snapshot of its state
  kExploiting,  // reading peers' scores, copying a donor, exploring
};
const char* phaseName(Phase phase);

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad input from the caller: names the field or parameter, what was expected and what was got.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// Anything that concerns one worker: carries its rank and the phase it was in.
class WorkerError : public Error {
 public:
  WorkerError(const std::string& what, int rank, Phase phase)
      : Error(what), rank_(rank), phase_(phase) {}
  int rank() const noexcept { return rank_; }
  Phase phase() const noexcept { return phase_; }

 private:
  int rank_;
  Phase phase_;
};

// The user's shard function threw, or returned something unusable (no loss, a
// non-positive sample count, a gradient of the wrong shape). The step is not
// applied; the workers are alive and the aggregator stays usable.
class WorkerFailed : public WorkerError {
 public:
  WorkerFailed(const std::string& what, int rank, Phase phase, std::string message)
      : WorkerError(what, rank, phase), message_(std::move(message)) {}
  // The worker's own message (e.g. the exception's what()).
  const std::string& message() const noexcept { return message_; }

 private:
  std::string message_;
};

// A worker's gradient (or loss) was NaN or infinite, with NonFinitePolicy::kRaise,
// or too many consecutive steps were skipped with kSkipStep. Nothing is applied;
// the aggregator stays usable.
class NonFiniteGradient : public WorkerFailed {
 public:
  NonFiniteGradient(const std::string& what, int rank, Phase phase, std::string message,
                    std::string parameter)
      : WorkerFailed(what, rank, phase, std::move(message)), parameter_(std::move(parameter)) {}
  // The first parameter with a non-finite gradient, or "" when it was the loss.
  const std::string& parameter() const noexcept { return parameter_; }

 private:
  std::string parameter_;
};

// A worker process exited or was killed. The step is not applied; the other
// workers are stopped and the aggregator is no longer usable.
class WorkerDied : public WorkerError {
 public:
  WorkerDied(const std::string& what, int rank, Phase phase, int exit_status, int signal)
      : WorkerError(what, rank, phase), exit_status_(exit_status), signal_(signal) {}
  int exitStatus() const noexcept { return exit_status_; }  // -1 when killed by a signal
  int signal() const noexcept { return signal_; }           // 0 when it exited
 private:
  int exit_status_;
  int signal_;
};

// A worker did not finish within Options::step_timeout. The step is not applied;
// the workers are stopped and the aggregator is no longer usable.
class StepTimeout : public WorkerError {
 public:
  using WorkerError::WorkerError;
};

// Across nodes: a peer node died or stalled past NodeOptions::timeout, the
// rendezvous failed, or the nodes' parameters diverged. This node's workers are
// stopped and nothing of the failed step is applied here; the aggregator is no
// longer usable.
class NodeFailed : public Error {
 public:
  NodeFailed(const std::string& what, int node) : Error(what), node_(node) {}
  int node() const noexcept { return node_; }  // this node's rank

 private:
  int node_;
};

// Across nodes: interruptWaits() (a stop signal) ended a wait on the other
// nodes. As with NodeFailed, nothing of the step is applied and the aggregator
// is no longer usable; this node's connections to the others are closed, so
// they fail with NodeFailed at once instead of at their timeout.
class Interrupted : public NodeFailed {
 public:
  using NodeFailed::NodeFailed;
};

// A file gradagg writes or reads for the caller (a checkpoint, the population's
// lineage) could not be: names the file; the operating system's reason is in what().
class FileError : public Error {
 public:
  FileError(const std::string& what, std::string path) : Error(what), path_(std::move(path)) {}
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

// step() after shutdown() or after an error that stopped the workers.
class NotUsable : public Error {
 public:
  using Error::Error;
};

// A broken invariant inside gradagg: a bug, please report it.
class InternalError : public Error {
 public:
  using Error::Error;
};

}  // namespace gradagg
