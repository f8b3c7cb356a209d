#include "runtime/heap.h"

#include <climits>  // also defines __GLIBC__ where it applies
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace gradagg::detail {

namespace {

constexpr int kGlibcDefaultThreshold = 128 * 1024;

// The value of `name` in GLIBC_TUNABLES ("a=1:b=2"), or `fallback`.
int tunable(const char* name, int fallback) {
  const char* all = std::getenv("GLIBC_TUNABLES");
  if (!all) return fallback;
  const std::string text = all;
  const std::string key = std::string(name) + "=";
  std::size_t at = 0;
  while (at < text.size()) {
    std::size_t end = text.find(':', at);
    if (end == std::string::npos) end = text.size();
    if (text.compare(at, key.size(), key) == 0) {
      char* stop = nullptr;
      const long long v = std::strtoll(text.c_str() + at + key.size(), &stop, 0);
      if (stop != text.c_str() + at + key.size() && v >= 0 && v <= INT_MAX)
        return static_cast<int>(v);
      return fallback;
    }
    at = end + 1;
  }
  return fallback;
}

std::mutex holders_mutex;
int holders = 0;  // live KeptHeap objects that changed the heap

}  // namespace

bool keepFreedMemory() noexcept {
#if defined(__GLIBC__)
  // The largest threshold mallopt accepts on 64-bit glibc (HEAP_MAX_SIZE / 2).
  constexpr int kMmapThreshold = 32 << 20;
  constexpr int kHeapMax = 64 << 20;  // HEAP_MAX_SIZE, the size of a thread arena's heap
  // Setting either value also ends the dynamic threshold.
  const bool mmap_ok = ::mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1;
  const bool trim_ok = ::mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  // A thread other than the main one allocates from an arena of heaps of at
  // most 64 MiB, and glibc unmaps such a heap as soon as all of it is free,
  // whatever the trim threshold (heap_trim): a worker's serving thread, or the
  // parent's optimizer in a Python thread, would map and fault in its step's
  // temporaries anew every step. A top pad of a whole heap keeps every heap.
  const bool pad_ok = ::mallopt(M_TOP_PAD, kHeapMax) == 1;
  return mmap_ok && trim_ok && pad_ok;
#else
  return false;
#endif
}

void restoreHeap() noexcept {
#if defined(__GLIBC__)
  ::mallopt(M_MMAP_THRESHOLD, tunable("glibc.malloc.mmap_threshold", kGlibcDefaultThreshold));
  ::mallopt(M_TRIM_THRESHOLD, tunable("glibc.malloc.trim_threshold", kGlibcDefaultThreshold));
  ::mallopt(M_TOP_PAD, tunable("glibc.malloc.top_pad", kGlibcDefaultThreshold));
  ::malloc_trim(0);
#endif
}

KeptHeap::KeptHeap(bool keep) {
  if (!keep) return;
  std::lock_guard<std::mutex> lock(holders_mutex);
  if (holders == 0 && !keepFreedMemory()) return;
  ++holders;
  held_ = true;
}

KeptHeap& KeptHeap::operator=(KeptHeap&& o) noexcept {
  if (this != &o) {
    release();
    held_ = o.held_;
    o.held_ = false;
  }
  return *this;
}

void KeptHeap::release() noexcept {
  if (!held_) return;
  held_ = false;
  std::lock_guard<std::mutex> lock(holders_mutex);
  if (--holders == 0) restoreHeap();
}

}  // namespace gradagg::detail
