// Ending a node's waits on the other nodes from a signal handler.
#pragma once

namespace gradagg {

// Async-signal-safe: every wait of this process on other nodes (at the
// rendezvous, for a slow peer, inside a cross-node collective) ends within
// about 50 ms with gradagg::Interrupted, and the waits after it end at once.
// Call it from a SIGINT or SIGTERM handler; the Python module calls it on
// Ctrl-C. It lasts for the life of the process (a stop signal that comes while
// the Aggregator is still being made ends its rendezvous too); the Python
// module clears it as it makes an Aggregator. One node's
// waits are on its own workers and already end on a stop (docs/errors.md).
void interruptWaits() noexcept;

}  // namespace gradagg
