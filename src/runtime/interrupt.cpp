#include "runtime/interrupt.h"

#include <time.h>

#include <algorithm>
#include <atomic>

#include <gradagg/interrupt.h>

#include "runtime/timeouts.h"

namespace gradagg {
namespace {
// Written by a signal handler (interruptWaits), read by the waits; lock-free,
// so both are async-signal-safe. A request is its time and its patience; the
// time is written before `g_interrupted`, which publishes it.
std::atomic<bool> g_interrupted{false};
std::atomic<std::int64_t> g_requested_ns{0};
std::atomic<std::int64_t> g_patience_ns{0};
static_assert(std::atomic<bool>::is_always_lock_free);
static_assert(std::atomic<std::int64_t>::is_always_lock_free);
}  // namespace

void interruptWaits() noexcept { interruptWaits(std::chrono::milliseconds(0)); }

void interruptWaits(std::chrono::milliseconds patience) noexcept {
  if (g_interrupted.load(std::memory_order_acquire)) return;  // the first request stands
  // Capped as every timeout here (runtime/timeouts.h): milliseconds::max() as
  // "never" would overflow the nanoseconds.
  g_patience_ns.store(std::max<std::int64_t>(0, detail::saturated(patience).count()) * 1000000,
                      std::memory_order_relaxed);
  g_requested_ns.store(detail::monotonicNowNs(), std::memory_order_relaxed);
  g_interrupted.store(true, std::memory_order_release);
}

namespace detail {
std::int64_t monotonicNowNs() noexcept {
  struct timespec t {};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return std::int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

bool interruptDue(std::int64_t began_ns) noexcept {
  if (!g_interrupted.load(std::memory_order_acquire)) return false;
  if (began_ns == 0) return true;
  const std::int64_t since = std::max(g_requested_ns.load(std::memory_order_relaxed), began_ns);
  return monotonicNowNs() - since >= g_patience_ns.load(std::memory_order_relaxed);
}

void clearInterrupt() noexcept { g_interrupted.store(false, std::memory_order_release); }
}  // namespace detail

}  // namespace gradagg
