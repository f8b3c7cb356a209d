// The flat gradient: every parameter as a byte range of one buffer, the same
// offsets in the snapshot, the results and every slot (step/layout.h), and the
// ranges the workers reduce.
#pragma once

#include <cstdint>
#include <vector>

#include <c10/core/ScalarType.h>

#include "step/kernels.h"

namespace gradagg::detail {

class ModelBinding;

// One parameter in the flat gradient: plain data, so the reduction needs no torch.
struct FlatTensor {
  std::uint64_t offset = 0;  // bytes, a multiple of 64
  std::uint64_t count = 0;   // elements
  ElementType type = ElementType::kFloat32;
  bool trainable = true;  // requires_grad: only these are reduced
};

struct ByteRange {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

// How the reduction sees a parameter's (or floating buffer's) dtype.
ElementType elementTypeOf(c10::ScalarType t);

// The model's parameters as the reduction sees them, in binding order.
std::vector<FlatTensor> flatParams(const ModelBinding& binding);

// [0, total_bytes) cut into `parts` ranges of nearly equal size on 64-byte
// boundaries (element boundaries inside every parameter). Some may be empty.
std::vector<ByteRange> splitRanges(std::uint64_t total_bytes, int parts);
// The same over `whole` (its begin on a 64-byte boundary, as every parameter's
// offset is): e.g. the last bucket, which the workers reduce.
std::vector<ByteRange> splitRanges(ByteRange whole, int parts);

// For every trainable parameter overlapping `range`, writes
// out[k] = sum_i w[i] * slots[i][k] over the overlap into `out` (a result
// region); `slots` are the slots' gradient areas. A parameter no worker gave a
// gradient sums to zero (slots are zeroed each step); one that is not trainable
// is left untouched.
void reduceRange(const std::vector<FlatTensor>& params, ByteRange range, std::byte* out,
                 const std::byte* const* slots, const double* w, int n);

}  // namespace gradagg::detail
