#include "runtime/sync.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <sched.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>

namespace gradagg::detail {

namespace {
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}
}  // namespace

void futexWait(const std::atomic<std::uint32_t>& word, std::uint32_t expected,
               std::chrono::nanoseconds slice) {
  if (slice.count() <= 0) return;
  timespec ts;
  ts.tv_sec = static_cast<time_t>(slice.count() / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(slice.count() % 1'000'000'000);
  // EAGAIN (value changed), EINTR and ETIMEDOUT all mean: look again.
  ::syscall(SYS_futex, reinterpret_cast<const std::uint32_t*>(&word), FUTEX_WAIT, expected, &ts,
            nullptr, 0);
}

void futexWakeAll(std::atomic<std::uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, INT32_MAX, nullptr,
            nullptr, 0);
}

namespace {
template <typename Done>
std::uint32_t spin(const std::atomic<std::uint32_t>& word, Done done,
                   std::chrono::nanoseconds budget) {
  std::uint32_t v = word.load(std::memory_order_acquire);
  if (done(v) || budget.count() <= 0) return v;
  const auto until = Clock::now() + budget;
  for (unsigned i = 1;; ++i) {
    cpuRelax();
    v = word.load(std::memory_order_acquire);
    if (done(v)) return v;
    if ((i & 63) == 0) {
      if (Clock::now() >= until) return v;
      ::sched_yield();
    }
  }
}
}  // namespace

std::uint32_t spinWhileEqual(const std::atomic<std::uint32_t>& word, std::uint32_t expected,
                             std::chrono::nanoseconds budget) {
  return spin(
      word, [expected](std::uint32_t v) { return v != expected; }, budget);
}

std::uint32_t spinUntilEqual(const std::atomic<std::uint32_t>& word, std::uint32_t target,
                             std::chrono::nanoseconds budget) {
  return spin(
      word, [target](std::uint32_t v) { return v == target; }, budget);
}

std::chrono::nanoseconds spinBudget(std::chrono::nanoseconds fallback) {
  const char* env = std::getenv("GRADAGG_SPIN_US");
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const long long us = std::strtoll(env, &end, 10);
  if (*end == '\0' && us >= 0 && us <= 1000000) return std::chrono::microseconds(us);
  // Read once when the library loads, where an exception would abort: say so, go on.
  std::fprintf(stderr,
               "gradagg: GRADAGG_SPIN_US='%s' is not a number of microseconds in 0..1000000; "
               "using the default %lld\n",
               env, static_cast<long long>(fallback.count() / 1000));
  return fallback;
}

}  // namespace gradagg::detail
