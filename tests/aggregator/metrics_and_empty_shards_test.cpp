// What comes back besides the gradient, and workers with nothing to do: named
// metrics summed over the workers, and shards with 0 samples (the last, uneven
// batch of an epoch) that leave the mean over the samples that exist, compared
// with one process's autograd on the same rows.
#include <string>
#include <vector>

#include "behaviour.h"
#include "support/expect_throws.h"

namespace gradagg_test {
namespace {

TEST_F(Behaviour, MetricsAreSummedOverTheWorkersAndKeptPerWorker) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 12, torch::kFloat);
  auto inner = shardFn(*model, data, shardBounds(12, 3, true));
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        auto r = inner(c);
        r.metrics = {{"correct", c.rank + 1.0}, {"step", static_cast<double>(c.step)}};
        return r;
      },
      opts(3));
  for (int s = 0; s < 2; ++s) {
    const auto& report = agg.step();
    EXPECT_EQ(report.metrics.size(), 2u);
    EXPECT_EQ(report.metrics.at("correct"), 1 + 2 + 3);
    EXPECT_EQ(report.metrics.at("step"), 3 * s);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(report.workers[r].metrics.at("correct"), r + 1.0);
  }
}

TEST_F(Behaviour, AccumulatedMetricsAreTheWorkersSumOverItsMicroBatches) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  auto o = opts(2);
  o.accumulation_steps = 3;
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        return gradagg::ShardResult{
            model->loss(model->forward(data.x), data.y), 4, {{"micro", c.micro_step + 0.5}}};
      },
      o);
  const auto& report = agg.step();
  EXPECT_EQ(report.workers[0].metrics.at("micro"), 0.5 + 1.5 + 2.5);
  EXPECT_EQ(report.metrics.at("micro"), 2 * (0.5 + 1.5 + 2.5));
}

TEST_F(Behaviour, OtherMetricNamesThanTheFirstStepsAreAnInvalidArgumentAndNothingIsApplied) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        gradagg::ShardResult r{model->loss(model->forward(data.x), data.y), 4, {{"correct", 1}}};
        if (c.step == 1 && c.rank == 1) r.metrics = {{"accuracy", 1}};
        return r;
      },
      opts(2));
  agg.step();
  const auto params = paramsOf(*model);
  const auto grads = gradsOf(*model);
  expectThrows<gradagg::InvalidArgument>([&] { agg.step(); }, "'accuracy'");
  EXPECT_EQ(agg.stepsDone(), 1);
  EXPECT_TRUE(bitIdentical(paramsOf(*model), params));
  expectClose(gradsOf(*model), grads, 0, ".grad after the refused step");
  EXPECT_TRUE(agg.usable());
}

TEST_F(Behaviour, TooManyOrTooLongMetricNamesAreAWorkerFailedNamingThem) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(
      *model,
      [&, calls = 0](const gradagg::ShardContext&) mutable {
        gradagg::ShardResult r{model->loss(model->forward(data.x), data.y), 4, {}};
        if (++calls == 1) r.metrics[std::string(60, 'm')] = 1;
        if (calls == 2)
          for (int i = 0; i < 17; ++i) r.metrics["m" + std::to_string(i)] = i;
        return r;
      },
      opts(1));
  expectThrows<gradagg::WorkerFailed>([&] { agg.step(); }, std::string(60, 'm'));
  expectThrows<gradagg::WorkerFailed>([&] { agg.step(); }, "17 metrics");
}

// --- empty shards -------------------------------------------------------------------------

// Worker r computes model.loss on rows [bounds[r], bounds[r+1]); an empty range
// returns 0 samples and no loss.
gradagg::ShardFn maybeEmpty(TestModel& model, const Data& data, std::vector<int64_t> bounds) {
  return [&model, &data, bounds](const gradagg::ShardContext& c) {
    const int64_t lo = bounds[c.rank], hi = bounds[c.rank + 1];
    if (lo == hi) return gradagg::ShardResult{at::Tensor(), 0, {}};
    auto x = data.x.slice(0, lo, hi), y = data.y.slice(0, lo, hi);
    return gradagg::ShardResult{
        model.loss(model.forward(x), y), hi - lo, {{"rows", double(hi - lo)}}};
  };
}

TEST_F(Behaviour, TheUnevenLastBatchIsTheMeanOverTheSamplesThatExist) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  auto reference = copyModel(*model);
  const Data data = makeData(ModelKind::kMlp, 5, torch::kFloat);
  // 5 rows on 4 workers the way a DistributedSampler without padding leaves them.
  gradagg::Aggregator agg(*model, maybeEmpty(*model, data, {0, 2, 4, 5, 5}), opts(4));
  const auto& report = agg.step();
  EXPECT_EQ(report.samples, 5);
  EXPECT_EQ(report.workers[3].samples, 0);
  EXPECT_EQ(report.workers[3].metrics.at("rows"), 0) << "the agreed names, 0 when it had none";
  EXPECT_EQ(report.metrics.at("rows"), 5);
  expectClose(gradsOf(*model), fullBatchGrads(*reference, data), 1e-5, "gradients");
}

TEST_F(Behaviour, AnEmptyWorkerHasNoShareInTheMeanBuffers) {
  // BatchNorm in training mode normalises each shard by its own statistics: the
  // reference is the contributors' per-shard gradients, weighted by samples.
  auto model = makeModel(ModelKind::kConvBnTrain, torch::kFloat);
  auto reference = copyModel(*model);
  const Data data = makeData(ModelKind::kConvBnTrain, 5, torch::kFloat);
  auto o = opts(4);
  o.buffers = gradagg::BufferSync::kMean;
  gradagg::Aggregator agg(*model, maybeEmpty(*model, data, {0, 0, 2, 5, 5}), o);
  agg.step();
  expectClose(gradsOf(*model), perShardGrads(*reference, data, {0, 2, 5}, true), 1e-5, "gradients");
  // The running mean: the contributors' mean weighted by samples is the whole batch's.
  reference->forward(data.x);
  const auto want = reference->named_buffers(), got = model->named_buffers();
  int checked = 0;
  for (const auto& b : want) {
    if (b.key().find("running_mean") == std::string::npos) continue;
    EXPECT_LT(relErr(got[b.key()], b.value()), 1e-5) << b.key();
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST_F(Behaviour, EqualWeightingCountsOnlyTheWorkersWithSamples) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  auto reference = copyModel(*model);
  const Data data = makeData(ModelKind::kMlp, 6, torch::kFloat);
  auto o = opts(3);
  o.weighting = gradagg::Weighting::kEqual;
  gradagg::Aggregator agg(*model, maybeEmpty(*model, data, {0, 0, 2, 6}), o);
  agg.step();
  // One process: the mean of the two contributors' losses.
  auto loss =
      0.5 * (reference->loss(reference->forward(data.x.slice(0, 0, 2)), data.y.slice(0, 0, 2)) +
             reference->loss(reference->forward(data.x.slice(0, 2, 6)), data.y.slice(0, 2, 6)));
  loss.backward();
  expectClose(gradsOf(*model), gradsOf(*reference), 1e-5, "equal weighting");
}

TEST_F(Behaviour, AnEmptyMicroBatchLeavesTheMeanOverTheSamplesThatExist) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  auto reference = copyModel(*model);
  const Data data = makeData(ModelKind::kMlp, 7, torch::kFloat);
  auto o = opts(2);
  o.accumulation_steps = 2;
  // Micro-batches (worker, micro): (0,0) rows 0-2, (0,1) 3-4, (1,0) 5-6, (1,1) none.
  const std::vector<int64_t> lo = {0, 3, 5, 7}, hi = {3, 5, 7, 7};
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        const int i = 2 * c.rank + c.micro_step;
        if (lo[i] == hi[i]) return gradagg::ShardResult{at::Tensor(), 0, {}};
        const auto x = data.x.slice(0, lo[i], hi[i]), y = data.y.slice(0, lo[i], hi[i]);
        return gradagg::ShardResult{model->loss(model->forward(x), y), hi[i] - lo[i], {}};
      },
      o);
  EXPECT_EQ(agg.step().samples, 7);
  expectClose(gradsOf(*model), fullBatchGrads(*reference, data), 1e-5, "accumulated");
}

TEST_F(Behaviour, AParameterNoContributorReachedKeepsAnUndefinedGrad) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        if (c.rank == 0) return gradagg::ShardResult{at::Tensor(), 0, {}};
        // y = theta * x + bias without the bias: it gets a gradient from nobody.
        const auto theta = model->named_parameters()["theta"];
        return gradagg::ShardResult{(theta * data.x - data.y).pow(2).mean(), 4, {}};
      },
      opts(2));
  ASSERT_EQ(model->parameters().size(), 2u);  // theta, bias
  agg.step();
  EXPECT_TRUE(model->parameters()[0].grad().defined());
  EXPECT_FALSE(model->parameters()[1].grad().defined());
}

TEST_F(Behaviour, AStepWhereEveryWorkerIsEmptyIsAnInvalidArgumentAndNothingIsApplied) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kFloat);
  auto inner = shardFn(*model, data, shardBounds(8, 2, false));
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        if (c.step == 1) return gradagg::ShardResult{at::Tensor(), 0, {}};
        return inner(c);
      },
      opts(2));
  agg.step();
  const auto params = paramsOf(*model);
  const auto grads = gradsOf(*model);
  expectThrows<gradagg::InvalidArgument>([&] { agg.step(); }, "0 samples");
  EXPECT_TRUE(bitIdentical(paramsOf(*model), params));
  expectClose(gradsOf(*model), grads, 0, ".grad after the empty step");
  EXPECT_EQ(agg.stepsDone(), 1);
  EXPECT_TRUE(agg.usable());
}

}  // namespace
}  // namespace gradagg_test
