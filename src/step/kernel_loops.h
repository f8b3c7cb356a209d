// The portable loops behind kernels.h, shared by its translation units
// (kernels.cpp: float64, bf16, fp16 and the dispatch; kernels_f32.cpp: float32).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "step/kernels.h"
#include "step/layout.h"  // kMaxSlots

// GCC on x86-64: function multiversioning and the hand-vectorised paths.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GRADAGG_X86_GCC 1
#endif

// The loops compiled twice, for AVX2 and for the x86-64 baseline, picked at load
// time. Neither uses FMA (and kernels*.cpp build with -ffp-contract=off), so
// both round exactly alike: results do not depend on which one runs. Not under
// ThreadSanitizer: GCC instruments the clones' resolver, which the dynamic loader
// runs before TSan's runtime is set up (every program died by SIGSEGV at load).
#if defined(GRADAGG_X86_GCC) && !defined(__SANITIZE_THREAD__)
#define GRADAGG_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GRADAGG_CLONES
#endif

#ifdef GRADAGG_X86_GCC  // the intrinsics of the hand-vectorised paths
// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_*, GCC PR105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace gradagg::detail {

// Blocks of kBlock elements keep the double accumulators in L1 and let the
// compiler vectorise the inner loop over elements.
constexpr std::size_t kBlock = 512;

template <typename T>
[[gnu::always_inline]] inline void weightedSumT(T* __restrict out, const void* const* in,
                                                const double* w, int n, std::size_t count) {
  double acc[kBlock];
  for (std::size_t begin = 0; begin < count; begin += kBlock) {
    const std::size_t len = std::min(kBlock, count - begin);
    const T* __restrict first = static_cast<const T*>(in[0]) + begin;
    const double w0 = w[0];
    for (std::size_t k = 0; k < len; ++k) acc[k] = w0 * static_cast<double>(first[k]);
    for (int i = 1; i < n; ++i) {
      const T* __restrict src = static_cast<const T*>(in[i]) + begin;
      const double wi = w[i];
      for (std::size_t k = 0; k < len; ++k) acc[k] += wi * static_cast<double>(src[k]);
    }
    for (std::size_t k = 0; k < len; ++k) out[begin + k] = static_cast<T>(acc[k]);
  }
}

// Elements [begin, end) of a sum, by `loop` (a portable one): the heads and
// tails that a hand-vectorised path leaves.
template <typename T, typename Loop>
void sumPart(Loop loop, T* out, const void* const* in, const double* w, int n, std::size_t begin,
             std::size_t end) {
  if (begin >= end) return;
  std::array<const void*, kMaxSlots> rest{};
  for (int i = 0; i < n; ++i) rest[i] = static_cast<const T*>(in[i]) + begin;
  loop(out + begin, rest.data(), w, n, end - begin);
}

// Which vectorised paths may run (setKernelPathForTests); kBest otherwise.
extern std::atomic<KernelPath> kernel_path;

void weightedSumF32(float* out, const void* const* in, const double* w, int n, std::size_t count);

}  // namespace gradagg::detail
