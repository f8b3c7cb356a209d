// The request behind gradagg::interruptWaits(): set from a signal handler,
// read by every wait on other nodes (topology/).
#pragma once

#include <cstdint>

namespace gradagg::detail {

// CLOCK_MONOTONIC in ns (async-signal-safe).
std::int64_t monotonicNowNs() noexcept;

// A wait that began at `began_ns` (monotonicNowNs()) ends now: a request is
// pending and its patience has passed since both the request and `began_ns`.
// 0: the rendezvous, which ends at once whatever the patience (there is no
// step there to let finish).
bool interruptDue(std::int64_t began_ns = 0) noexcept;
// A new group of nodes starts uninterrupted.
void clearInterrupt() noexcept;

}  // namespace gradagg::detail
