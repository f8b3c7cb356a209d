// The reduction: the weighted sum of one range of the gradient over all slots.
// Fixed order (slot 0, 1, ..., N-1 for every element), accumulated in double,
// so the result is bit-for-bit the same whoever computes which range.
#pragma once

#include <cstddef>

namespace gradagg::detail {

enum class ElementType { kFloat32, kFloat64 };

// out[k] = (T)(w[0]*in[0][k] + w[1]*in[1][k] + ... + w[n-1]*in[n-1][k]) for k in
// [0, count), summed left to right in double. `out` may alias none of `in`.
void weightedSum(ElementType type, void* out, const void* const* in, const double* w, int n,
                 std::size_t count);

}  // namespace gradagg::detail
