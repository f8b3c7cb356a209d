#include "step/buckets.h"

#include <algorithm>
#include <numeric>

namespace gradagg::detail {

namespace {

BucketPlan cut(const ModelBinding& binding, const std::vector<std::size_t>& by_offset,
               std::uint64_t first_bytes, std::uint64_t bucket_bytes) {
  const auto& params = binding.params();
  BucketPlan plan;
  plan.of_param.assign(params.size(), -1);
  c10::ScalarType open_dtype = c10::ScalarType::Undefined;
  std::uint64_t open_bytes = 0;
  bool open = false;
  std::uint64_t limit = first_bytes;       // of the open bucket
  for (const std::size_t k : by_offset) {  // from the end of the flat gradient
    const TensorEntry& p = params[k];
    // A parameter without a gradient never opens a bucket of its own.
    if (open && (p.dtype != open_dtype || (open_bytes >= limit && p.requires_grad))) open = false;
    if (!open) {
      limit = p.dtype != open_dtype ? first_bytes : bucket_bytes;
      if (p.dtype != open_dtype) ++plan.dtype_runs;
      plan.ranges.push_back(ByteRange{p.offset, p.offset});
      plan.dtypes.push_back(p.dtype);
      open_dtype = p.dtype;
      open_bytes = 0;
      open = true;
    }
    ByteRange& bucket = plan.ranges.back();
    bucket.end = std::max(bucket.end, p.offset + p.bytes);
    bucket.begin = p.offset;
    open_bytes += p.bytes;
    if (p.requires_grad) plan.of_param[k] = plan.size() - 1;
  }
  // Each bucket ends where the one before it (in crossing order) begins: the
  // alignment padding between parameters travels with the bucket below it.
  for (int b = 1; b < plan.size(); ++b) plan.ranges[b].end = plan.ranges[b - 1].begin;
  if (!plan.ranges.empty()) plan.ranges.front().end = binding.paramBytes();
  return plan;
}

}  // namespace

BucketPlan planBuckets(const ModelBinding& binding, std::uint64_t first_bytes,
                       std::uint64_t bucket_bytes, bool overlap) {
  const auto& params = binding.params();
  std::vector<std::size_t> by_offset(params.size());
  std::iota(by_offset.begin(), by_offset.end(), 0);
  std::sort(by_offset.begin(), by_offset.end(),
            [&](std::size_t a, std::size_t b) { return params[a].offset > params[b].offset; });
  first_bytes = std::max<std::uint64_t>(first_bytes, 1);
  bucket_bytes = std::max<std::uint64_t>(bucket_bytes, 1);
  BucketPlan plan = cut(binding, by_offset, first_bytes, bucket_bytes);
  while (plan.size() > kMaxEarlyBuckets + 1) {
    first_bytes *= 2;
    bucket_bytes *= 2;
    plan = cut(binding, by_offset, first_bytes, bucket_bytes);
  }
  plan.overlap = overlap;
  return plan;
}

}  // namespace gradagg::detail
