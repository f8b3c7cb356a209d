// The reduction's second stage: what happens to a step after this group's
// workers summed their slots into the result. The parent's step calls it the
// same way whatever lies behind it, as c10d's Reducer is blind to how many
// machines its process group spans: for one group of workers it is the
// LocalStage below, which has nothing to combine; topology/topology.h makes
// the others.
//
// The stage owns the tail after each result in the step's segment (tailBytes(),
// opaque to the step); it reads the workers' slots only through the
// Contribution it is given (step/outcome.h).
#pragma once

#include <cstdint>
#include <vector>

#include "step/buckets.h"
#include "step/layout.h"
#include "step/outcome.h"

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
  // The reduce phase (step/outcome.h): after this group's workers reduced
  // into result region `result`, combines `local` with the other groups'.
  // When nothing failed anywhere, the returned Reduced's result region holds
  // the mean gradient. Throws the stage's Error.
  virtual Reduced reduce(const Contribution& local, int result) {
    return Reduced::of(local, result);
  }
  // BufferSync::kFromRank0, after a step that goes through: `local` (the
  // first worker's slot buffers) in, where the first worker's buffers of the
  // first group lie out (the stage's own copy, or `local` itself).
  virtual const std::byte* firstBuffers(const std::byte* local) { return local; }
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
