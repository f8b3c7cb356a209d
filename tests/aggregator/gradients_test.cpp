// The mean gradient equals single-process autograd, for every model, worker
// count, dtype and shard split.
#include "support/support.h"

namespace gradagg_test {
namespace {

struct GradCase {
  ModelKind kind;
  int workers;
  torch::Dtype dtype;
  bool unequal;
};

std::string caseName(const ::testing::TestParamInfo<GradCase>& info) {
  const GradCase& c = info.param;
  return kindName(c.kind) + "_" + std::to_string(c.workers) + "Workers_" +
         (c.dtype == torch::kFloat ? "Float32" : "Float64") + (c.unequal ? "_Unequal" : "_Equal");
}

class MeanGradient : public GradaggTest, public ::testing::WithParamInterface<GradCase> {};

// Tolerance: relative error in the 2-norm per parameter. fp32 sums of a few
// hundred terms round differently in the two computations: 1e-5; fp64: 1e-12.
double tolerance(torch::Dtype dtype) { return dtype == torch::kFloat ? 1e-5 : 1e-12; }

TEST_P(MeanGradient, EqualsSingleProcessAutograd) {
  const GradCase c = GetParam();
  auto model = makeModel(c.kind, c.dtype);
  const Data data = makeData(c.kind, 24, c.dtype);
  const auto bounds = shardBounds(24, c.workers, c.unequal);

  // The independent computation. BatchNorm in training mode normalises each
  // shard with its own statistics (as DDP without SyncBatchNorm does), so its
  // reference is the sample-weighted sum of per-shard losses, still one process.
  const auto want = c.kind == ModelKind::kConvBnTrain ? perShardGrads(*model, data, bounds, true)
                                                      : fullBatchGrads(*model, data);

  gradagg::Options options;
  options.workers = c.workers;
  options.step_timeout = std::chrono::seconds(60);
  gradagg::Aggregator agg(*model, shardFn(*model, data, bounds), options);
  const auto& report = agg.step();
  EXPECT_EQ(report.samples, 24);
  expectClose(gradsOf(*model), want, tolerance(c.dtype), caseName({c, 0}));

  // The reported loss is the sample-weighted mean: the full-batch loss.
  if (c.kind != ModelKind::kConvBnTrain) {
    auto ref = copyModel(*model);
    torch::NoGradGuard no_grad;
    const double full = ref->loss(ref->forward(data.x), data.y).item<double>();
    EXPECT_NEAR(report.loss, full, std::abs(full) * tolerance(c.dtype) * 10);
  }
}

std::vector<GradCase> allCases() {
  std::vector<GradCase> cases;
  for (auto kind :
       {ModelKind::kLinear, ModelKind::kMlp, ModelKind::kConvBnEval, ModelKind::kConvBnTrain})
    for (int workers : {1, 2, 3, 4})
      for (auto dtype : {torch::kFloat, torch::kDouble})
        for (bool unequal : {false, true}) {
          if (workers == 1 && unequal) continue;  // one shard is one shard
          cases.push_back({kind, workers, dtype, unequal});
        }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Models, MeanGradient, ::testing::ValuesIn(allCases()), caseName);

}  // namespace
}  // namespace gradagg_test
