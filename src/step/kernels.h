// The kernels of the reduction: the weighted sum of the slots, element by element.
//
// A fixed order: slot 0, 1, ..., N-1 for
// every element, accumulated in double (float32, float64) or in float (bf16,
// fp16: converted on load, rounded once on store). The result is therefore
// bit-for-bit the same whoever computes which range, and from run to run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradagg::detail {

enum class ElementType { kFloat32, kFloat64, kBFloat16, kFloat16 };
std::size_t elementBytes(ElementType type);

// data[k] = (T)((double)data[k] * factor). float32 and float64 only.
void scaleInPlace(ElementType type, void* data, std::size_t count, double factor);

// out[k] = (T)(w[0]*in[0][k] + ... + w[n-1]*in[n-1][k]), summed left to right in
// double (in float for bf16 and fp16), rounded once to T.
void weightedSum(ElementType type, void* out, const void* const* in, const double* w, int n,
                 std::size_t count);

// float32, bf16 and fp16 have hand-vectorised paths (AVX-512, AVX2, F16C)
// picked at run time; all give the same bits. Tests force each in turn (kAvx2:
// no AVX-512; kPortable: the compiler's loops); kBest otherwise.
enum class KernelPath { kBest, kAvx2, kPortable };
void setKernelPathForTests(KernelPath path);

// True when none of the `count` elements is NaN or infinite.
bool allFinite(ElementType type, const void* data, std::size_t count);

}  // namespace gradagg::detail
