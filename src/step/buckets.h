// Buckets: how a reduction stage takes the gradient, as DDP's Reducer cuts it.
//
// The parameters are taken in reverse registration order (the order backward
// produces their gradients in, roughly) and cut into buckets: a bucket holds
// parameters of one dtype, and closes at the first parameter that brings it to
// `bucket_bytes`, the first of each dtype at `first_bytes` (a frozen parameter
// joins the open bucket). Parameters are laid out by dtype, in registration
// order within each (model/model_binding.h), so every bucket is one contiguous
// byte range of the flat gradient, and bucket 0 lies at its end.
//
// Bucket b is "early" when b < early(): the stage may take its sum while the
// workers are still in backward (the last bucket goes with the end of the step).
// There are early buckets only with `overlap` and when some dtype needs more
// than one bucket.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model_binding.h"
#include "step/flat.h"
#include "step/layout.h"  // kMaxEarlyBuckets: one arrive line each in the header

namespace gradagg::detail {

struct BucketPlan {
  std::vector<ByteRange> ranges;        // in the order they cross: bucket 0 first
  std::vector<c10::ScalarType> dtypes;  // of each bucket
  std::vector<int> of_param;  // bucket of each parameter (binding order); -1 without a gradient
  int dtype_runs = 0;         // contiguous runs of one dtype (float32, float64, ...)
  bool overlap = false;

  int size() const { return static_cast<int>(ranges.size()); }
  // One bucket per dtype run (or none): the gradient goes as one piece per run.
  bool whole() const { return size() == dtype_runs; }
  int early() const { return overlap && !whole() ? size() - 1 : 0; }
  // What the workers reduce after every slot is complete: everything, or with
  // early buckets the last bucket only (the parent reduced the others).
  ByteRange workerPart(std::uint64_t param_bytes) const {
    return early() > 0 ? ranges.back() : ByteRange{0, param_bytes};
  }
};

// The plan for `binding` with buckets of about `bucket_bytes`, the first of
// each dtype of about `first_bytes`. With more than kMaxEarlyBuckets + 1
// buckets both sizes are doubled until they fit.
BucketPlan planBuckets(const ModelBinding& binding, std::uint64_t first_bytes,
                       std::uint64_t bucket_bytes, bool overlap);

}  // namespace gradagg::detail
