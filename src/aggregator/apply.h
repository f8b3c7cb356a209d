// The parent's side of a step once the workers have arrived: read what they
// left in the segment (the local outcome), and make the step visible to the
// user (the parameters' .grad, the model's buffers, the report). Nothing the
// user can see changes anywhere else.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include <gradagg/options.h>
#include <gradagg/step_report.h>

#include "core/layout.h"
#include "core/model_binding.h"
#include "core/stage.h"
#include "core/sync.h"

namespace gradagg::detail {

// What this node's workers left after they arrived on `reduced`.
struct LocalOutcome {
  int failed = -1;      // the first rank whose status is kFailed, or -1
  int non_finite = -1;  // the first rank whose status is kNonFinite, or -1
  StepTotals totals;
};

// When the parent's step passed its marks (for the report).
struct StepTimes {
  Clock::time_point begin;    // step() called
  Clock::time_point command;  // just before the command
  Clock::time_point reduced;  // every worker arrived on `reduced`
  double node_ms = 0;         // the reduction's second stage
};

class Applier {
 public:
  Applier(ModelBinding& binding, const SegmentMap& segment, const Options& options);

  // Statuses, weights (as the closer wrote them), totals and the has-grad
  // flags (per parameter: did one of this node's workers produce a gradient).
  LocalOutcome collect();
  // The flags collect() found; the second stage turns them into every node's.
  std::vector<std::uint8_t>& flags() { return any_grad_; }

  // .grad of every flagged parameter becomes a view of result `result`; the
  // others' .grad becomes undefined.
  void gradients(int result);
  // Every .grad undefined: optimizer.step() then changes nothing (a skipped step).
  void clearGradients();
  // The parent's buffers, as Options::buffers says (worker 0's are slot 0's).
  void buffers();
  // The step's report, from the workers' control blocks and `totals`.
  void report(StepReport& report, std::int64_t step, const StepTotals& totals,
              const StepTimes& times) const;

 private:
  ModelBinding& binding_;
  SegmentMap segment_;
  const Options& options_;
  int workers_ = 0;
  std::vector<at::Tensor> result_views_[2];  // per parameter, into each result
  std::vector<std::uint8_t> any_grad_;
  std::vector<double> weights_;      // this step's, by rank
  std::vector<const void*> inputs_;  // reused by the buffer mean
};

}  // namespace gradagg::detail
