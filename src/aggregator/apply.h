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

  // .grad of every parameter flagged in `any_grad` becomes a view of result
  // `result`, or, where every gradient it got was sparse, a sparse coalesced
  // gradient over the rows the workers touched (step/sparse_rows.h; across
  // nodes the stage left everyone's rows in slot 0's); the others' .grad
  // becomes undefined.
  void gradients(int result, const std::vector<std::uint8_t>& any_grad);
  // Every .grad undefined: optimizer.step() then changes nothing (a skipped step).
  void clearGradients();
  // The parent's buffers, as Options::buffers says (worker 0's are slot 0's,
  // which the stage may have replaced: ReductionStage::shareFirstBuffers).
  void buffers();
  // The step's report, from the workers' control blocks and `totals`.
  void report(StepReport& report, std::int64_t step, const StepTotals& totals,
              const StepTimes& times) const;

 private:
  ModelBinding& binding_;
  SegmentMap segment_;
  const Options& options_;
  int workers_ = 0;
  SlotReader slots_;
  std::vector<at::Tensor> result_views_[2];  // per parameter, into each result
  RowMap row_map_;
  std::vector<std::uint8_t> touched_;  // a sparse parameter's rows, this step
  std::vector<double> weights_;        // this step's, by rank
  std::vector<const void*> inputs_;    // reused by the buffer mean
};

}  // namespace gradagg::detail
