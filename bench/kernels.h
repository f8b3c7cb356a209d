// The memory-bound kernels the reduce-only configuration measures side by side.
#pragma once

#include <cstddef>

#include "step/flat.h"

namespace gradagg::bench {

// out[k] = sum_i weights[i] * slots[i][k], i = 0..n-1 in order: the slot
// reduction gradagg runs each step, split into n ranges reduced in parallel by n
// persistent threads (as the n workers do). Not reentrant.
// `type`: the slots' element type (bf16 and fp16: summed in float, rounded once).
void reduceSlots(detail::ElementType type, void* out, const void* const* slots,
                 const double* weights, int n, std::size_t count);

// c[k] = a[k] + b[k]: the plain streaming kernel, the bandwidth reference, on
// the same n threads as the reduction. Not reentrant.
void streamAdd(float* c, const float* a, const float* b, std::size_t count, int n);

}  // namespace gradagg::bench
