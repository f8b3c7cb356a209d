// The reduction's second stage: what happens to a step after this group's
// workers summed their slots into the result. The parent's step calls it the
// same way whatever lies behind it, as c10d's Reducer is blind to how many
// machines its process group spans: for one group of workers it is the
// LocalStage below, which has nothing to combine; topology/topology.h makes
// the others.
//
// The stage owns two things of the step's segment: the tail after each result
// (tailBytes(), opaque to the step) and, with BufferSync::kFromRank0, the right
// to replace the first worker's buffers before the parent takes them.
#pragma once

#include <cstdint>
#include <vector>

#include "step/buckets.h"
#include "step/layout.h"
#include "step/slots.h"

namespace gradagg::detail {

class ReductionStage {
 public:
  virtual ~ReductionStage() = default;

  // Bytes the stage keeps after each result (a multiple of 64).
  virtual std::uint64_t tailBytes() const { return 0; }
  // true: the workers leave sum_i n_i g_i and the stage divides by the
  // combined D (WeightRule::divided_later); false: they leave the mean.
  virtual bool dividesLater() const { return false; }
  // The buckets in which the stage takes the gradient; early ones
  // (BucketPlan::early) it takes while the workers compute.
  virtual const BucketPlan& buckets() const { return whole_; }
  // Once, when the segment is mapped and its snapshot holds the parent's
  // values, before any worker is forked.
  virtual void attach(const SegmentMap& /*segment*/) {}

  // Before step `step` is first commanded: once per step, also when a group
  // redoes it with fresh workers (Options::max_restarts). Throws the stage's Error.
  virtual void beforeStep(std::int64_t /*step*/) {}
  // After this group's workers reduced into result region `result`: combines
  // the totals; when nothing failed anywhere, also the result (left as the
  // mean gradient) and `any_grad` (per parameter: in, this group's flags; out,
  // everyone's). Throws the stage's Error.
  virtual StepTotals reduce(const StepTotals& local, std::vector<std::uint8_t>& /*any_grad*/,
                            int /*result*/) {
    return local;
  }
  // BufferSync::kFromRank0, after a step that went through: `buffers` (the
  // first worker's slot buffers) become the first worker's of every group.
  virtual void shareFirstBuffers(std::byte* /*buffers*/) {}
  // Early bucket `bucket` of this group is summed in result region `result`:
  // start combining it (in the background: reduce() waits for it and reports
  // its failure). `overlapped`: the workers were still computing when it went.
  virtual void sendEarly(int /*bucket*/, int /*result*/, bool /*overlapped*/) {}
  // How many early buckets of the current step were sent (reduce() resets it).
  virtual int earlySent() const { return 0; }

 private:
  BucketPlan whole_;  // no buckets: the workers reduce the whole gradient
};

// One group: the workers' result is already the mean; nothing to combine.
class LocalStage final : public ReductionStage {};

}  // namespace gradagg::detail
