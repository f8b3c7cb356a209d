// Gradient accumulation (Options::accumulation_steps): k micro-batches per
// worker add up in its slot before the one reduction, and .grad is what one
// process computes on all the samples of the step at once.
#include "support/support.h"

namespace gradagg_test {
namespace {

constexpr int kWorkers = 3;
constexpr int kMicro = 4;

// 12 micro-batches of 4, 5 or 6 rows (60 in all): worker r's micro-batch i is piece r * k + i.
std::vector<int64_t> pieceBounds() {
  std::vector<int64_t> b{0};
  for (int i = 0; i < kWorkers * kMicro; ++i) b.push_back(b.back() + 4 + i % 3);
  return b;
}

gradagg::ShardFn microShards(TestModel& model, const Data& data, std::vector<int64_t> b) {
  return [&model, &data, b](const gradagg::ShardContext& ctx) {
    if (ctx.micro_steps != kMicro) throw std::logic_error("micro_steps is not k");
    const int piece = ctx.rank * ctx.micro_steps + ctx.micro_step;
    const int64_t lo = b[piece], hi = b[piece + 1];
    return gradagg::ShardResult{
        model.loss(model.forward(data.x.slice(0, lo, hi)), data.y.slice(0, lo, hi)), hi - lo};
  };
}

class Accumulation : public GradaggTest, public ::testing::WithParamInterface<torch::Dtype> {};

TEST_P(Accumulation, BySamplesIsTheGradientOfAllMicroBatchesAtOnce) {
  const torch::Dtype dtype = GetParam();
  auto model = makeModel(ModelKind::kMlp, dtype);
  const Data data = makeData(ModelKind::kMlp, 60, dtype);
  const auto want = fullBatchGrads(*model, data);
  gradagg::Options options;
  options.workers = kWorkers;
  options.accumulation_steps = kMicro;
  gradagg::Aggregator agg(*model, microShards(*model, data, pieceBounds()), options);
  const auto& report = agg.step();
  EXPECT_EQ(report.samples, 60);
  for (int r = 0; r < kWorkers; ++r) EXPECT_EQ(report.workers[r].samples, 19 + r);
  // The loss too: the full batch's mean loss.
  auto ref = copyModel(*model);
  EXPECT_NEAR(report.loss, ref->loss(ref->forward(data.x), data.y).item<double>(),
              dtype == torch::kFloat ? 1e-5 : 1e-12);
  expectClose(gradsOf(*model), want, dtype == torch::kFloat ? 1e-5 : 1e-12, "accumulated");
}

TEST_P(Accumulation, EqualIsTheMeanOfEveryMicroBatchGradient) {
  const torch::Dtype dtype = GetParam();
  auto model = makeModel(ModelKind::kMlp, dtype);
  const Data data = makeData(ModelKind::kMlp, 60, dtype);
  const auto want = perShardGrads(*model, data, pieceBounds(), /*by_samples=*/false);
  gradagg::Options options;
  options.workers = kWorkers;
  options.accumulation_steps = kMicro;
  options.weighting = gradagg::Weighting::kEqual;
  gradagg::Aggregator agg(*model, microShards(*model, data, pieceBounds()), options);
  agg.step();
  expectClose(gradsOf(*model), want, dtype == torch::kFloat ? 1e-5 : 1e-12, "accumulated");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Accumulation, ::testing::Values(torch::kFloat, torch::kDouble),
                         [](const auto& tested) {
                           return tested.param == torch::kFloat ? "Float32" : "Float64";
                         });

TEST_F(GradaggTest, AccumulatedTrainingMatchesOneProcessStepForStep) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  auto single = copyModel(*model);
  const Data data = makeData(ModelKind::kMlp, 60, torch::kFloat);
  torch::optim::Adam opt(model->parameters(), 0.01);
  torch::optim::Adam single_opt(single->parameters(), 0.01);
  gradagg::Options options;
  options.workers = kWorkers;
  options.accumulation_steps = kMicro;
  gradagg::Aggregator agg(*model, microShards(*model, data, pieceBounds()), options);
  for (int s = 0; s < 5; ++s) {
    stepOneProcess(*single, single_opt, data);
    agg.step();
    opt.step();
    expectClose(paramsOf(*model), paramsOf(*single), 1e-5, "after step " + std::to_string(s));
  }
}

TEST_F(GradaggTest, AccumulationStepsOutOfRangeIsInvalidArgument) {
  gradagg::Options options;
  options.accumulation_steps = 0;
  try {
    options.validate();
    FAIL() << "no exception";
  } catch (const gradagg::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("accumulation_steps"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gradagg_test
