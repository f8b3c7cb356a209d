#include "runtime/interrupt.h"

#include <atomic>

#include <gradagg/interrupt.h>

namespace gradagg {
namespace {
// Written by a signal handler (interruptWaits), read by the waits; lock-free,
// so both are async-signal-safe.
std::atomic<bool> g_interrupted{false};
static_assert(std::atomic<bool>::is_always_lock_free);
}  // namespace

void interruptWaits() noexcept { g_interrupted.store(true, std::memory_order_relaxed); }

namespace detail {
bool interruptRequested() noexcept { return g_interrupted.load(std::memory_order_relaxed); }
void clearInterrupt() noexcept { g_interrupted.store(false, std::memory_order_relaxed); }
}  // namespace detail

}  // namespace gradagg
