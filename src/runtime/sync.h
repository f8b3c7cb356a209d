// Waiting on 32-bit words in the segment: spin briefly, then block in a futex
// with a bounded slice, so every wait can check its deadline and liveness.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace gradagg::detail {

using Clock = std::chrono::steady_clock;

// Blocks while word == expected, for at most `slice` (may wake spuriously).
// The word lives in a MAP_SHARED mapping, so the futex is not process-private.
void futexWait(const std::atomic<std::uint32_t>& word, std::uint32_t expected,
               std::chrono::nanoseconds slice);
void futexWakeAll(std::atomic<std::uint32_t>& word);

// Spins up to `spin` until word != expected; returns the value seen last. The
// loop pauses between reads and yields the core now and then, so a process that
// has work (the parent's optimizer step, a peer's backward) is not starved by a
// spinning one on a machine with fewer cores than processes.
std::uint32_t spinWhileEqual(const std::atomic<std::uint32_t>& word, std::uint32_t expected,
                             std::chrono::nanoseconds spin);
// The same, until word == target.
std::uint32_t spinUntilEqual(const std::atomic<std::uint32_t>& word, std::uint32_t target,
                             std::chrono::nanoseconds spin);
// How long waits spin before they block, from GRADAGG_SPIN_US if set (for tuning), else `fallback`.
std::chrono::nanoseconds spinBudget(std::chrono::nanoseconds fallback);

inline std::int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

inline double millisSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace gradagg::detail
