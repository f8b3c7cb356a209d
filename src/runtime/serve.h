// The serve loop: the life of a forked worker, whichever mode forked it.
//
// Set up once and arrive for start-up; then, until the stop command, wait for
// the next command and serve it, each command ending with the worker's last
// arrival on the mode's done line (WorkerChannel::finish). The aggregator's
// workers and the population's members are this loop with their own set-up
// and their own command.
#pragma once

#include <atomic>
#include <cstdint>

#include "runtime/control.h"

namespace gradagg::detail {

class ServedWorker {
 public:
  virtual ~ServedWorker() = default;
  // Once, in the child. What it throws is handed to failed() and the worker
  // stays unready: it exits with kExitSetUpFailed at the next command.
  virtual void setUp() = 0;
  // Records the exception being handled as this worker's failure (its status
  // and message, where the parent reads them).
  virtual void failed() noexcept = 0;
  // Whether this worker owes the start-up arrival (a member forked again after
  // its predecessor arrived for the current command does not).
  virtual bool arrivesAtStart() const { return true; }
  // The command just published is the stop command.
  virtual bool stopCommanded() const = 0;
  // Serves the command just published, up to (not including) its last
  // arrival. false: the parent is gone.
  virtual bool serve() = 0;
};

// Runs `worker` over `channel` from command `start_seq` on; every command ends
// with one arrival on `done_line`. Returns the child's exit status: 0 after
// the stop command, kExitSetUpFailed or kExitParentLost (runtime/process.h).
int serveCommands(ServedWorker& worker, WorkerChannel& channel,
                  std::atomic<std::uint32_t>& done_line, std::uint32_t start_seq);

}  // namespace gradagg::detail
