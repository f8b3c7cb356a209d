#include "sync.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

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

std::uint32_t spinWhileEqual(const std::atomic<std::uint32_t>& word, std::uint32_t expected,
                             std::chrono::nanoseconds spin) {
  const auto until = Clock::now() + spin;
  std::uint32_t v = word.load(std::memory_order_acquire);
  for (int i = 0; v == expected; ++i) {
    cpuRelax();
    if ((i & 63) == 63 && Clock::now() >= until) break;
    v = word.load(std::memory_order_acquire);
  }
  return v;
}

}  // namespace gradagg::detail
