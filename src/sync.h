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

// Spins up to `spin` for word != expected; returns the value seen last.
std::uint32_t spinWhileEqual(const std::atomic<std::uint32_t>& word, std::uint32_t expected,
                             std::chrono::nanoseconds spin);

inline double millisSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace gradagg::detail
