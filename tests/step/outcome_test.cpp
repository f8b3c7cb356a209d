// The step's outcome (step/outcome.h): the verdict's order, and one group's
// Reduced being its Contribution.
#include <vector>

#include <gtest/gtest.h>

#include "step/outcome.h"
#include "step/sparse_rows.h"

namespace gradagg::detail {
namespace {

const std::vector<std::uint8_t> kHasGrad = {kDenseGrad, 0, kSparseGrad};
const std::vector<std::uint8_t> kRows = {0, 1, 1, 0};

Contribution withSamples(double weight_total) {
  Contribution c;
  c.sums.weight_total = weight_total;
  c.sums.samples = static_cast<std::int64_t>(weight_total);
  c.has_grad = kHasGrad;
  return c;
}

TEST(StepOutcome, OneGroupsReducedIsItsContributionInTheResultItNames) {
  Contribution c = withSamples(12);
  c.sums.loss = 0.25;
  c.sums.metrics.count = 2;
  c.sums.metrics.values[0] = 3;
  c.sums.metrics.values[1] = 4;
  c.rows = kRows;
  const Reduced r = Reduced::of(c, 1);
  EXPECT_EQ(r.result, 1);
  EXPECT_FALSE(r.failed);
  EXPECT_FALSE(r.non_finite);
  EXPECT_EQ(r.sums.weight_total, 12);
  EXPECT_EQ(r.sums.samples, 12);
  EXPECT_EQ(r.sums.loss, 0.25);
  EXPECT_EQ(r.sums.metrics.count, 2);
  EXPECT_EQ(r.sums.metrics.values[1], 4);
  EXPECT_EQ(r.has_grad.vec(), kHasGrad);
  EXPECT_EQ(r.rows.vec(), kRows);
  EXPECT_EQ(r.wire.collectives, 0);
  EXPECT_EQ(judge(c, r), Verdict::kApply);
}

TEST(StepOutcome, TheVerdictNamesThisGroupsFailureBeforeAnyOtherGroups) {
  Contribution c = withSamples(4);
  Reduced all = Reduced::of(c, 0);
  EXPECT_EQ(judge(c, all), Verdict::kApply);

  // Everyone's sums are what decide "no samples", not this group's.
  Contribution none = withSamples(0);
  EXPECT_EQ(judge(none, all), Verdict::kApply);
  all.sums.weight_total = 0;
  EXPECT_EQ(judge(c, all), Verdict::kNoSamples);

  all.non_finite = true;
  EXPECT_EQ(judge(c, all), Verdict::kNonFinite);
  all.failed = true;
  EXPECT_EQ(judge(c, all), Verdict::kFailedElsewhere);

  c.metric_error = "worker 1 returned the metrics [\"a\"]";
  EXPECT_TRUE(c.failed());
  EXPECT_EQ(judge(c, all), Verdict::kMetricsDiffer);
  c.failed_rank = 2;
  EXPECT_EQ(judge(c, all), Verdict::kWorkerFailed);
}

TEST(StepOutcome, AContributionThatFailsOrGaveUpSaysSoToTheStage) {
  Contribution c = withSamples(4);
  EXPECT_FALSE(c.failed());
  c.non_finite_rank = 0;
  EXPECT_FALSE(c.failed());  // a non-finite gradient is the policy's, not a failure
  EXPECT_TRUE(c.nonFinite());
  EXPECT_TRUE(Reduced::of(c, 0).non_finite);

  Contribution given_up;
  given_up.abandoned = true;
  EXPECT_TRUE(given_up.failed());
  EXPECT_TRUE(Reduced::of(given_up, 0).failed);
}

}  // namespace
}  // namespace gradagg::detail
