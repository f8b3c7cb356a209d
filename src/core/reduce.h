// The reduction: the weighted sum of the slots into the mean gradient.
//
// Every worker reduces one range of the flat gradient over all slots (a
// reduce-scatter in shared memory), in a fixed order: slot 0, 1, ..., N-1 for
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

// One parameter in the flat gradient: plain data, so this file needs no torch.
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

// [0, total_bytes) cut into `parts` ranges of nearly equal size on 64-byte
// boundaries (element boundaries inside every parameter). Some may be empty.
std::vector<ByteRange> splitRanges(std::uint64_t total_bytes, int parts);
// The same over `whole` (its begin on a 64-byte boundary, as every parameter's
// offset is): e.g. the last bucket, which the workers reduce.
std::vector<ByteRange> splitRanges(ByteRange whole, int parts);

// w_i = samples_i / sum(samples), or 1 / n when `equal`; without `normalize`,
// w_i = samples_i, or 1 (across nodes the division comes after the allreduce).
void computeWeights(bool equal, const std::int64_t* samples, int n, double* w,
                    bool normalize = true);

// Slot i's weight in the reduction: the step's weight w_i (computeWeights) as
// is, or, accumulating k > 1 micro-batches, divided by k (equal weighting) or
// by the worker's samples (its slot then holds sum_j n_j g_j).
double slotWeight(double step_weight, bool equal, int k, std::int64_t samples);

// data[k] = (T)((double)data[k] * factor). float32 and float64 only.
void scaleInPlace(ElementType type, void* data, std::size_t count, double factor);

// For every trainable parameter overlapping `range`, writes
// out[k] = sum_i w[i] * slots[i][k] over the overlap into `out` (a result
// region); `slots` are the slots' gradient areas. A parameter no worker gave a
// gradient sums to zero (slots are zeroed each step); one that is not trainable
// is left untouched.
void reduceRange(const std::vector<FlatTensor>& params, ByteRange range, std::byte* out,
                 const std::byte* const* slots, const double* w, int n);

// out[k] = (T)(w[0]*in[0][k] + ... + w[n-1]*in[n-1][k]), summed left to right in
// double (in float for bf16 and fp16), rounded once to T.
void weightedSum(ElementType type, void* out, const void* const* in, const double* w, int n,
                 std::size_t count);

// bf16 and fp16 have hand-vectorised paths (AVX-512, AVX2 + F16C) picked at
// run time; all give the same bits. Tests force each in turn; kBest otherwise.
enum class HalfPath { kBest, kAvx2, kPortable };
void setHalfPathForTests(HalfPath path);

// True when none of the `count` elements is NaN or infinite.
bool allFinite(ElementType type, const void* data, std::size_t count);

}  // namespace gradagg::detail
