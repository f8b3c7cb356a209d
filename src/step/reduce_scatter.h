// The reduction in the segment: the weighted sum of every slot into the result,
// a reduce-scatter in shared memory, in one place.
//
//   close()        the worker that took the N-th from `computed` (the closer)
//                  sees every slot: it writes whether every status is ok, D and
//                  every slot's weight (WeightRule), then takes the last one;
//   reduce(range)  after `computed` read 0, each worker sums its range of the
//                  flat gradient over all slots, in rank order, into the result
//                  the command names (nothing when the step failed);
//   reduceEarly(b) the parent, once every worker took bucket b's line (their
//                  counts are written by then): the same sum over bucket b,
//                  with the weights the same rule gives those samples.
// Every element is summed in the same order whoever sums it (step/kernels.h),
// so the result's bits do not depend on which process reduced which range.
#pragma once

#include <cstdint>
#include <vector>

#include "step/flat.h"
#include "step/layout.h"
#include "step/slots.h"
#include "step/weights.h"

namespace gradagg::detail {

class ReduceScatter {
 public:
  ReduceScatter(const SegmentMap& map, std::vector<FlatTensor> flat, WeightRule rule);

  // The closer, in a worker: the step's summary, then the last arrival is its caller's.
  void close();
  // A worker, after `computed` read 0: its range of this step's result.
  void reduce(ByteRange range);
  // The parent: early bucket `range` of this step into result `result`; the
  // first call of a step (`first`) weighs the slots by their samples.
  void reduceEarly(ByteRange range, int result, bool first);

  const WeightRule& rule() const { return rule_; }

 private:
  SegmentMap map_;
  SlotReader slots_;
  std::vector<FlatTensor> flat_;
  WeightRule rule_;
  int n_;
  std::vector<const std::byte*> gradients_;  // every slot's gradient area
  std::vector<SlotCounts> counts_;
  std::vector<SlotWeight> weights_;  // the parent's early buckets' (before the closer's)
  std::vector<double> factors_;
};

}  // namespace gradagg::detail
