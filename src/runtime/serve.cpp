#include "runtime/serve.h"

#include "runtime/process.h"

namespace gradagg::detail {

int serveCommands(ServedWorker& worker, WorkerChannel& channel,
                  std::atomic<std::uint32_t>& done_line, std::uint32_t start_seq) {
  std::uint32_t seen = start_seq;
  bool ready = true;
  try {
    worker.setUp();
  } catch (...) {
    worker.failed();
    ready = false;
  }
  if (worker.arrivesAtStart()) channel.finish(done_line, seen);
  for (;;) {
    const auto next = channel.awaitCommand(seen);
    if (!next) return kExitParentLost;
    seen = *next;
    // An unready worker waits for the parent to read its message and stop it.
    if (!ready) return kExitSetUpFailed;
    if (worker.stopCommanded()) {
      channel.setPhase(Phase::kStopping);
      return 0;
    }
    if (!worker.serve()) return kExitParentLost;
    channel.finish(done_line, seen);
  }
}

}  // namespace gradagg::detail
