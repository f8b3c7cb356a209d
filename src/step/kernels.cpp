#include "step/kernels.h"

#include <cstring>

#include <c10/util/Half.h>

#include "step/kernel_loops.h"

namespace gradagg::detail {

std::atomic<KernelPath> kernel_path{KernelPath::kBest};

namespace {

// bf16 and fp16 (the upper half of a float32; IEEE binary16), as bits. Loads
// widen exactly; stores round to nearest even (c10's rules: the same bits as
// LibTorch's own conversions).
inline float bf16ToFloat(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline std::uint16_t floatToBf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint16_t>(nan ? 0x7fc0u : rounded);  // a select: the loop vectorises
}

template <bool kBf16>
[[gnu::always_inline]] inline void weightedSumHalfT(std::uint16_t* __restrict out,
                                                    const void* const* in, const double* w, int n,
                                                    std::size_t count) {
  const auto load = [](std::uint16_t v) {
    return kBf16 ? bf16ToFloat(v) : c10::detail::fp16_ieee_to_fp32_value(v);
  };
  float acc[kBlock];
  for (std::size_t begin = 0; begin < count; begin += kBlock) {
    const std::size_t len = std::min(kBlock, count - begin);
    for (int i = 0; i < n; ++i) {
      const std::uint16_t* __restrict src = static_cast<const std::uint16_t*>(in[i]) + begin;
      const float wi = static_cast<float>(w[i]);
      if (i == 0)
        for (std::size_t k = 0; k < len; ++k) acc[k] = wi * load(src[k]);
      else
        for (std::size_t k = 0; k < len; ++k) acc[k] += wi * load(src[k]);
    }
    for (std::size_t k = 0; k < len; ++k)
      out[begin + k] = kBf16 ? floatToBf16(acc[k]) : c10::detail::fp16_ieee_from_fp32_value(acc[k]);
  }
}

// Elements [k, count) of a hand-vectorised half path: the portable loop.
template <bool kBf16>
void halfTail(std::uint16_t* out, const void* const* in, const double* w, int n, std::size_t count,
              std::size_t k) {
  const auto loop = [](std::uint16_t* o, const void* const* i, const double* ws, int m,
                       std::size_t c) { weightedSumHalfT<kBf16>(o, i, ws, m, c); };
  sumPart(loop, out, in, w, n, k, count);
}

// A float is NaN or infinite exactly when its exponent bits are all ones.
// Integer OR-reductions vectorise; float sums would not (no reassociation).
template <typename Bits>
bool allFiniteBits(const Bits* data, std::size_t count, Bits exponent) {
  Bits bad = 0;
  for (std::size_t k = 0; k < count; ++k)
    bad |= static_cast<Bits>((data[k] & exponent) == exponent);
  return bad == 0;
}

GRADAGG_CLONES void weightedSumF64(double* out, const void* const* in, const double* w, int n,
                                   std::size_t count) {
  weightedSumT(out, in, w, n, count);
}

GRADAGG_CLONES void weightedSumBf16Portable(std::uint16_t* out, const void* const* in,
                                            const double* w, int n, std::size_t count) {
  weightedSumHalfT<true>(out, in, w, n, count);
}

#ifdef GRADAGG_X86_GCC
// The same loop in AVX2 by hand (the compiler does not vectorise the widening
// and the rounding well): 8 elements at a time, the same operations in the
// same order as weightedSumHalfT<true>, so the same bits.
__attribute__((target("avx2"))) void weightedSumBf16Avx2(std::uint16_t* out, const void* const* in,
                                                         const double* w, int n,
                                                         std::size_t count) {
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i quiet_nan = _mm256_set1_epi32(0x7fc0);
  std::size_t k = 0;
  for (; k + 8 <= count; k += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; ++i) {
      const auto* src = static_cast<const std::uint16_t*>(in[i]) + k;
      const __m256i wide =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
      const __m256 prod = _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(w[i])), x);
      acc = i == 0 ? prod : _mm256_add_ps(acc, prod);
    }
    const __m256i u = _mm256_castps_si256(acc);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q));
    const __m256i bits = _mm256_blendv_epi8(rounded, quiet_nan, nan);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), packed);
  }
  halfTail<true>(out, in, w, n, count, k);
}

// And in AVX-512 (F + BW), 16 elements at a time: the widening and the
// rounding are compute, not memory, at 8 lanes on this machine's cores.
__attribute__((target("avx512f,avx512bw"))) void weightedSumBf16Avx512(std::uint16_t* out,
                                                                       const void* const* in,
                                                                       const double* w, int n,
                                                                       std::size_t count) {
  const __m512i bias = _mm512_set1_epi32(0x7fff);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i quiet_nan = _mm512_set1_epi32(0x7fc0);
  std::size_t k = 0;
  for (; k + 16 <= count; k += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; ++i) {
      const auto* src = static_cast<const std::uint16_t*>(in[i]) + k;
      const __m512i wide =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
      const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
      const __m512 prod = _mm512_mul_ps(_mm512_set1_ps(static_cast<float>(w[i])), x);
      acc = i == 0 ? prod : _mm512_add_ps(acc, prod);
    }
    const __m512i u = _mm512_castps_si512(acc);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q);
    const __m512i bits = _mm512_mask_blend_epi32(nan, rounded, quiet_nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm512_cvtepi32_epi16(bits));
  }
  halfTail<true>(out, in, w, n, count, k);
}
#endif

void weightedSumBf16(std::uint16_t* out, const void* const* in, const double* w, int n,
                     std::size_t count) {
#ifdef GRADAGG_X86_GCC
  static const bool avx512 =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  static const bool avx2 = __builtin_cpu_supports("avx2");
  const KernelPath path = kernel_path.load(std::memory_order_relaxed);
  if (avx512 && path == KernelPath::kBest) return weightedSumBf16Avx512(out, in, w, n, count);
  if (avx2 && path != KernelPath::kPortable) return weightedSumBf16Avx2(out, in, w, n, count);
#endif
  weightedSumBf16Portable(out, in, w, n, count);
}

GRADAGG_CLONES void weightedSumF16Portable(std::uint16_t* out, const void* const* in,
                                           const double* w, int n, std::size_t count) {
  weightedSumHalfT<false>(out, in, w, n, count);
}

#ifdef GRADAGG_X86_GCC
// fp16 <-> float in hardware (F16C: round to nearest even, as c10's conversion
// for every non-NaN value); c10's portable conversion does not vectorise.
__attribute__((target("avx2,f16c"))) void weightedSumF16C(std::uint16_t* out, const void* const* in,
                                                          const double* w, int n,
                                                          std::size_t count) {
  std::size_t k = 0;
  for (; k + 8 <= count; k += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; ++i) {
      const auto* src = static_cast<const std::uint16_t*>(in[i]) + k;
      const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      const __m256 prod = _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(w[i])), x);
      acc = i == 0 ? prod : _mm256_add_ps(acc, prod);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                     _mm256_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT));
  }
  halfTail<false>(out, in, w, n, count, k);
}
#endif

void weightedSumF16(std::uint16_t* out, const void* const* in, const double* w, int n,
                    std::size_t count) {
#ifdef GRADAGG_X86_GCC
  static const bool f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
  if (f16c && kernel_path.load(std::memory_order_relaxed) != KernelPath::kPortable)
    return weightedSumF16C(out, in, w, n, count);
#endif
  weightedSumF16Portable(out, in, w, n, count);
}

}  // namespace

void setKernelPathForTests(KernelPath path) { kernel_path.store(path); }

std::size_t elementBytes(ElementType type) {
  switch (type) {
    case ElementType::kFloat32:
      return 4;
    case ElementType::kFloat64:
      return 8;
    default:
      return 2;
  }
}

void scaleInPlace(ElementType type, void* data, std::size_t count, double factor) {
  if (type == ElementType::kFloat32) {
    auto* p = static_cast<float*>(data);
    for (std::size_t k = 0; k < count; ++k) p[k] = static_cast<float>(p[k] * factor);
  } else {
    auto* p = static_cast<double*>(data);
    for (std::size_t k = 0; k < count; ++k) p[k] = p[k] * factor;
  }
}

void weightedSum(ElementType type, void* out, const void* const* in, const double* w, int n,
                 std::size_t count) {
  if (count == 0 || n <= 0) return;
  // One slot at weight 1 (one worker, the step's mean): 1 * x is x, so the sum
  // is the slot's bytes (for every finite value; a step with a non-finite one
  // is never applied). A copy runs at memory speed, the loops below do not.
  if (n == 1 && w[0] == 1.0) {
    if (out != in[0]) std::memcpy(out, in[0], count * elementBytes(type));
    return;
  }
  switch (type) {
    case ElementType::kFloat32:
      return weightedSumF32(static_cast<float*>(out), in, w, n, count);
    case ElementType::kFloat64:
      return weightedSumF64(static_cast<double*>(out), in, w, n, count);
    case ElementType::kBFloat16:
      return weightedSumBf16(static_cast<std::uint16_t*>(out), in, w, n, count);
    case ElementType::kFloat16:
      return weightedSumF16(static_cast<std::uint16_t*>(out), in, w, n, count);
  }
}

bool allFinite(ElementType type, const void* data, std::size_t count) {
  switch (type) {
    case ElementType::kFloat32:
      return allFiniteBits(static_cast<const std::uint32_t*>(data), count,
                           std::uint32_t{0x7f800000u});
    case ElementType::kFloat64:
      return allFiniteBits(static_cast<const std::uint64_t*>(data), count,
                           std::uint64_t{0x7ff0000000000000ull});
    case ElementType::kBFloat16:
      return allFiniteBits(static_cast<const std::uint16_t*>(data), count, std::uint16_t{0x7f80u});
    case ElementType::kFloat16:
      return allFiniteBits(static_cast<const std::uint16_t*>(data), count, std::uint16_t{0x7c00u});
  }
  return false;
}

}  // namespace gradagg::detail
