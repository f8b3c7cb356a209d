// The parent's side of a step once the workers have arrived and the stage has
// combined their sums: make the step visible to the user (the parameters'
// .grad, the model's buffers, the report). Nothing the user can see changes
// anywhere else.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include <gradagg/options.h>
#include <gradagg/step_report.h>

#include "model/model_binding.h"
#include "runtime/sync.h"
#include "step/layout.h"
#include "step/outcome.h"
#include "step/slots.h"

namespace gradagg::detail {

// When the parent's step passed its marks (for the report).
struct StepTimes {
  Clock::time_point begin;    // step() called
  Clock::time_point command;  // just before the command
  Clock::time_point reduced;  // every worker arrived on `reduced`
  double stage_ms = 0;        // the reduction's second stage
};

class Applier {
 public:
  Applier(ModelBinding& binding, const SegmentMap& segment, const Options& options);

  // .grad of every parameter flagged in the step's has_grad becomes a view of
  // its result region, or, where every gradient it got was sparse, a sparse
  // coalesced gradient over the rows touched (step/sparse_rows.h); the
  // others' .grad becomes undefined.
  void gradients(const Reduced& step);
  // Every .grad undefined: optimizer.step() then changes nothing (a skipped step).
  void clearGradients();
  // The parent's buffers, as Options::buffers says: the workers' weighted
  // mean, or `first`, the first worker's (ReductionStage::firstBuffers).
  void buffers(const std::byte* first);
  // The step's report, from the workers' control blocks and the step's sums.
  void report(StepReport& report, std::int64_t step, const Reduced& totals,
              const StepTimes& times) const;

 private:
  ModelBinding& binding_;
  SegmentMap segment_;
  const Options& options_;
  int workers_ = 0;
  SlotReader slots_;
  std::vector<at::Tensor> result_views_[2];  // per parameter, into each result
  RowMap row_map_;
  std::vector<double> weights_;      // this step's, by rank
  std::vector<const void*> inputs_;  // reused by the buffer mean
};

}  // namespace gradagg::detail
