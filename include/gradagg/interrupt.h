// Ending a node's waits on the other nodes from a signal handler.
#pragma once

#include <chrono>

namespace gradagg {

// Async-signal-safe: every wait of this process on other nodes (at the
// rendezvous, for a slow peer, inside a cross-node collective) ends within
// about 10 ms with gradagg::Interrupted, and the waits after it end at once;
// this node's connections are shut down, so the peers fail at once too. Call
// it from a SIGINT or SIGTERM handler; the Python module calls it on Ctrl-C.
// It lasts for the life of the process (a stop signal that comes while the
// Aggregator is still being made ends its rendezvous too); the Python module
// clears it as it makes an Aggregator. One node's waits are on its own workers
// and already end on a stop (docs/errors.md). The first call stands: later
// ones change nothing.
void interruptWaits() noexcept;

// The same, with patience: a wait on the other nodes ends once `patience` has
// passed since both this call and the wait's own start. A step whose peers
// answer within `patience` of each of its waits ends as usual, however long
// its own compute takes, so a program that stops at the step's boundary keeps
// its stop checkpoint; a peer that is stopped, slow or gone ends the wait
// `patience` plus about 10 ms later. The rendezvous has no step to let finish
// and ends at once. The examples pass 100 ms.
void interruptWaits(std::chrono::milliseconds patience) noexcept;

}  // namespace gradagg
