// float32's weighted sum: the reduction of every float32 model, so the one
// that must run at the speed of memory. Three paths, the same bits: the
// portable loop (kernel_loops.h), and AVX2 and AVX-512 by hand, which widen
// each slot's floats to double, multiply by the slot's weight and add in slot
// order (no FMA), then round once to float, as static_cast<float> does.
//
// A result larger than the caches is written with streaming (non-temporal)
// stores: it is not read again before it has left them, and an ordinary store
// would first read each line it writes (a third input stream for two slots).
#include <cstdint>

#include "step/kernel_loops.h"

namespace gradagg::detail {

namespace {

GRADAGG_CLONES void f32Portable(float* out, const void* const* in, const double* w, int n,
                                std::size_t count) {
  weightedSumT(out, in, w, n, count);
}

#ifdef GRADAGG_X86_GCC
// From this many bytes of result on, its stores stream past the caches. Below,
// a reduction runs from cache step after step (670K parameters: 2.7 MB), and
// its result is read next from there.
constexpr std::size_t kStreamBytes = std::size_t{8} << 20;

// Elements before out + k is 64-byte aligned, as streaming stores need.
std::size_t alignedHead(const float* out, std::size_t count) {
  const auto addr = reinterpret_cast<std::uintptr_t>(out);
  if (addr % sizeof(float) != 0) return count;
  return std::min(count, (64 - addr % 64) % 64 / sizeof(float));
}

// Elements [k, count) 8 at a time, as two halves of 4 doubles; returns where it
// stopped (the portable loop does the rest).
template <bool kStream>
__attribute__((target("avx2"))) std::size_t f32Avx2(float* out, const void* const* in,
                                                    const double* w, int n, std::size_t k,
                                                    std::size_t count) {
  for (; k + 8 <= count; k += 8) {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (int i = 0; i < n; ++i) {
      const float* src = static_cast<const float*>(in[i]) + k;
      const __m256d wi = _mm256_set1_pd(w[i]);
      const __m256d pl = _mm256_mul_pd(wi, _mm256_cvtps_pd(_mm_loadu_ps(src)));
      const __m256d ph = _mm256_mul_pd(wi, _mm256_cvtps_pd(_mm_loadu_ps(src + 4)));
      lo = i == 0 ? pl : _mm256_add_pd(lo, pl);
      hi = i == 0 ? ph : _mm256_add_pd(hi, ph);
    }
    const __m256 r = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
    if constexpr (kStream)
      _mm256_stream_ps(out + k, r);
    else
      _mm256_storeu_ps(out + k, r);
  }
  return k;
}

// The same, 16 elements at a time as two halves of 8 doubles.
template <bool kStream>
__attribute__((target("avx512f"))) std::size_t f32Avx512(float* out, const void* const* in,
                                                         const double* w, int n, std::size_t k,
                                                         std::size_t count) {
  for (; k + 16 <= count; k += 16) {
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int i = 0; i < n; ++i) {
      const float* src = static_cast<const float*>(in[i]) + k;
      const __m512d wi = _mm512_set1_pd(w[i]);
      const __m512d pl = _mm512_mul_pd(wi, _mm512_cvtps_pd(_mm256_loadu_ps(src)));
      const __m512d ph = _mm512_mul_pd(wi, _mm512_cvtps_pd(_mm256_loadu_ps(src + 8)));
      lo = i == 0 ? pl : _mm512_add_pd(lo, pl);
      hi = i == 0 ? ph : _mm512_add_pd(hi, ph);
    }
    const __m512d both =
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm512_cvtpd_ps(lo))),
                           _mm256_castps_pd(_mm512_cvtpd_ps(hi)), 1);
    if constexpr (kStream)
      _mm512_stream_ps(out + k, _mm512_castpd_ps(both));
    else
      _mm512_storeu_ps(out + k, _mm512_castpd_ps(both));
  }
  return k;
}
#endif

}  // namespace

void weightedSumF32(float* out, const void* const* in, const double* w, int n, std::size_t count) {
  const auto portable = [](float* o, const void* const* i, const double* ws, int m, std::size_t c) {
    f32Portable(o, i, ws, m, c);
  };
#ifdef GRADAGG_X86_GCC
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2");
  const KernelPath path = kernel_path.load(std::memory_order_relaxed);
  const bool wide = avx512 && path == KernelPath::kBest;
  if (wide || (avx2 && path != KernelPath::kPortable)) {
    const bool stream = count * sizeof(float) >= kStreamBytes;
    std::size_t k = stream ? alignedHead(out, count) : 0;
    sumPart(portable, out, in, w, n, 0, k);
    if (wide)
      k = stream ? f32Avx512<true>(out, in, w, n, k, count)
                 : f32Avx512<false>(out, in, w, n, k, count);
    else
      k = stream ? f32Avx2<true>(out, in, w, n, k, count) : f32Avx2<false>(out, in, w, n, k, count);
    if (stream) _mm_sfence();  // the streamed lines are visible before the step goes on
    sumPart(portable, out, in, w, n, k, count);
    return;
  }
#endif
  portable(out, in, w, n, count);
}

}  // namespace gradagg::detail
