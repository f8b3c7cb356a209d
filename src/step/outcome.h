// A step's outcome, as the parent's three phases pass it forward:
//
//   collect  SlotReader::collect + MetricBook::collect  -> Contribution
//            what this group's workers left: who failed, the sums, which
//            parameters got a gradient, the sparse rows they touched;
//   reduce   ReductionStage::reduce(contribution)        -> Reduced
//            everyone's: the same fields over every group, and where the
//            mean gradient lies (a result region of the segment);
//   judge    judge(contribution, reduced)                -> Verdict
//            whether the step goes through, and if not, why;
//   apply    Applier (aggregator/apply.h) reads the Reduced.
//
// Each phase takes what the one before it returned, by const reference, and
// returns its own value: nothing is written back into an argument, and no
// phase leaves a value in a worker's slot for a later one to find there.
// The per-parameter flags and rows are views (c10::ArrayRef) of storage their
// phase keeps and reuses, so a step allocates nothing: a view is valid until
// its phase runs again, the next step.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/ArrayRef.h>

#include <gradagg/shard.h>

namespace gradagg::detail {

// ShardResult::metrics summed over workers (and, after the stage, nodes), in
// the agreed names' order (step/metrics.h).
struct MetricSums {
  int count = 0;  // names with a value; 0 when no worker with samples returned any
  std::array<double, ShardResult::kMaxMetrics> values{};
};

// What a step's workers add up to: one group's, or after the stage everyone's.
struct StepSums {
  double weight_total = 0;  // D: the samples, or one per worker with equal weighting
  // sum_i w_i loss_i with the step's weights (step/weights.h): the mean loss,
  // or, in a group whose stage divides later, sum_i n_i loss_i.
  double loss = 0;
  std::int64_t samples = 0;
  MetricSums metrics;
};

// The collect phase's value: this group's workers after they arrived on `reduced`.
struct Contribution {
  int failed_rank = -1;      // the first rank whose status is kFailed, or -1
  int non_finite_rank = -1;  // the first rank whose status is kNonFinite, or -1
  std::string metric_error;  // the workers' metric names differ: how (step/metrics.h)
  // The parent gave up waiting for its workers after early buckets went: it
  // takes part in the stage only so that the other groups see the step fail.
  bool abandoned = false;
  StepSums sums;
  // Per parameter, the workers' has-grad flags OR-ed (kDenseGrad, kSparseGrad).
  c10::ArrayRef<std::uint8_t> has_grad;
  // For parameters whose every gradient was sparse: the rows any worker
  // touched, one byte per row at RowMap::offset[k] (step/sparse_rows.h);
  // empty when there are none.
  c10::ArrayRef<std::uint8_t> rows;

  bool failed() const { return failed_rank >= 0 || !metric_error.empty() || abandoned; }
  bool nonFinite() const { return non_finite_rank >= 0; }
};

// What the stage's collectives carried, from this process (0 when there is
// nothing to combine).
struct WireTotals {
  std::uint64_t bytes = 0;  // contributed to the step's collectives
  int collectives = 0;      // that carried the step
  int overlapped = 0;       // of them, started while the workers computed
};

// The reduce phase's value: the step over every group.
struct Reduced {
  bool failed = false;      // a worker failed somewhere (or a group gave up)
  bool non_finite = false;  // a gradient or loss was NaN or infinite somewhere
  StepSums sums;            // everyone's; loss is the mean loss
  // The result region (layout.h) that holds the mean gradient of every
  // parameter flagged in has_grad; meaningful only when the step goes through.
  int result = 0;
  c10::ArrayRef<std::uint8_t> has_grad;  // everyone's, as Contribution::has_grad
  c10::ArrayRef<std::uint8_t> rows;      // everyone's, as Contribution::rows
  WireTotals wire;

  // One group's step: its contribution is everyone's.
  static Reduced of(const Contribution& local, int result) {
    Reduced r;
    r.failed = local.failed();
    r.non_finite = local.nonFinite();
    r.sums = local.sums;
    r.result = result;
    r.has_grad = local.has_grad;
    r.rows = local.rows;
    return r;
  }
};

// Whether a step goes through, and if not, whose failure stops it (in the
// order the parent reports them: its own workers' first).
enum class Verdict {
  kApply,          // apply the mean gradient
  kWorkerFailed,   // one of this group's workers failed (Contribution::failed_rank)
  kMetricsDiffer,  // this group's workers returned different metric names
  kFailedElsewhere,
  kNonFinite,  // here (non_finite_rank) or elsewhere: skipped or raised by policy
  kNoSamples,  // every worker everywhere returned 0 samples
};

inline Verdict judge(const Contribution& local, const Reduced& all) {
  if (local.failed_rank >= 0) return Verdict::kWorkerFailed;
  if (!local.metric_error.empty()) return Verdict::kMetricsDiffer;
  if (all.failed) return Verdict::kFailedElsewhere;
  if (all.non_finite) return Verdict::kNonFinite;
  if (all.sums.weight_total == 0) return Verdict::kNoSamples;
  return Verdict::kApply;
}

}  // namespace gradagg::detail
