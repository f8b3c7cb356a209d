// Timeouts as the runtime uses them. Deadlines are clock readings plus a
// timeout, in nanoseconds, which overflow beyond ~292 years (1e13 ms failed at
// once): a timeout longer than 30 days, longer than any step or rendezvous, is
// taken as 30 days rather than refused.
#pragma once

#include <algorithm>
#include <chrono>

namespace gradagg::detail {

constexpr std::chrono::milliseconds kLongestTimeout = std::chrono::hours(24 * 30);

inline std::chrono::milliseconds saturated(std::chrono::milliseconds t) {
  return std::min(t, kLongestTimeout);
}

}  // namespace gradagg::detail
