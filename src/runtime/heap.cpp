#include "runtime/heap.h"

#include <climits>  // also defines __GLIBC__ where it applies

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace gradagg::detail {

bool keepFreedMemory() noexcept {
#if defined(__GLIBC__)
  // The largest threshold mallopt accepts on 64-bit glibc (HEAP_MAX_SIZE / 2).
  constexpr int kMmapThreshold = 32 << 20;
  // Setting either value also ends the dynamic threshold.
  const bool mmap_ok = ::mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1;
  const bool trim_ok = ::mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  return mmap_ok && trim_ok;
#else
  return false;
#endif
}

}  // namespace gradagg::detail
