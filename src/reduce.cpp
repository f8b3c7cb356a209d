#include "reduce.h"

#include <algorithm>

namespace gradagg::detail {

namespace {

// Blocks of kBlock elements keep the double accumulators in L1 and let the
// compiler vectorise the inner loop over elements.
constexpr std::size_t kBlock = 512;

template <typename T>
void weightedSumT(T* __restrict out, const void* const* in, const double* w, int n,
                  std::size_t count) {
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

}  // namespace

void weightedSum(ElementType type, void* out, const void* const* in, const double* w, int n,
                 std::size_t count) {
  if (count == 0 || n <= 0) return;
  if (type == ElementType::kFloat32)
    weightedSumT(static_cast<float*>(out), in, w, n, count);
  else
    weightedSumT(static_cast<double*>(out), in, w, n, count);
}

}  // namespace gradagg::detail
