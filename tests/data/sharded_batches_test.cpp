// gradagg::data::ShardedBatches: the index rule against hand-written
// expectations and Python's torch.randperm, and training through it against one
// process over the same global batches.
#include <gradagg/data.h>

#include <numeric>
#include <set>

#include <fmt/format.h>

#include "support/expect_throws.h"
#include "support/support.h"

namespace {

using gradagg::ShardContext;
using gradagg::data::BatchPlan;
using gradagg::data::ShardedBatches;
using gradagg::data::ShardedBatchesOptions;
using namespace gradagg_test;

using Indices = std::vector<std::size_t>;

class ShardedBatchesTest : public GradaggTest {};

ShardedBatchesOptions shuffled(std::uint64_t seed, bool prefetch = false) {
  ShardedBatchesOptions o;
  o.shuffle = true;
  o.seed = seed;
  o.prefetch = prefetch;
  return o;
}

TEST_F(ShardedBatchesTest, TheRuleSplitsEachGlobalBatchIntoContiguousPartsThatDifferByAtMostOne) {
  const BatchPlan plan(10, 4);
  EXPECT_EQ(plan.steps_per_epoch(), 3);
  EXPECT_EQ(plan.epoch(2), 0);
  EXPECT_EQ(plan.epoch(3), 1);
  EXPECT_EQ(plan.indices(0), (Indices{0, 1, 2, 3}));
  EXPECT_EQ(plan.indices(0, 0, 3), (Indices{0, 1}));
  EXPECT_EQ(plan.indices(0, 1, 3), (Indices{2}));
  EXPECT_EQ(plan.indices(0, 2, 3), (Indices{3}));
  // The last, uneven batch of the epoch: 8, 9 over three workers.
  EXPECT_EQ(plan.indices(2, 0, 3), (Indices{8}));
  EXPECT_EQ(plan.indices(2, 1, 3), (Indices{9}));
  EXPECT_EQ(plan.indices(2, 2, 3), (Indices{}));
  // Epoch 1 starts over (unshuffled: the same order).
  EXPECT_EQ(plan.indices(3, 1, 3), (Indices{2}));
  // Micro-batches split the worker's part again: worker 0 of 2 has 0, 1.
  EXPECT_EQ(plan.indices(0, 0, 2, 0, 2), (Indices{0}));
  EXPECT_EQ(plan.indices(0, 0, 2, 1, 2), (Indices{1}));
  EXPECT_EQ(BatchPlan(10, 4, {false, 0, true}).steps_per_epoch(), 2);
  ShardContext ctx;
  ctx.step = 5;
  ctx.global_rank = 2;
  ctx.global_workers = 3;
  EXPECT_EQ(plan.samples(ctx), 0);
}

TEST_F(ShardedBatchesTest, AnEpochVisitsEverySampleOnceInPythonsRandpermOrder) {
  // torch.randperm(10, generator=torch.Generator().manual_seed(7 + e)).tolist()
  // printed by python3-torch 1.13.1 for e = 0 and 1.
  const Indices python_epoch0{5, 0, 3, 4, 1, 7, 9, 6, 8, 2};
  const Indices python_epoch1{3, 5, 0, 1, 2, 6, 4, 7, 8, 9};
  const BatchPlan plan(10, 4, shuffled(7));
  for (int e = 0; e < 2; ++e) {
    Indices epoch;
    std::set<std::size_t> seen;
    for (int s = 0; s < 3; ++s)
      for (int g = 0; g < 3; ++g)
        for (std::size_t i : plan.indices(e * 3 + s, g, 3)) {
          epoch.push_back(i);
          seen.insert(i);
        }
    EXPECT_EQ(epoch, e == 0 ? python_epoch0 : python_epoch1) << "epoch " << e;
    EXPECT_EQ(seen.size(), 10u);
  }
}

TEST_F(ShardedBatchesTest, BadInputIsAnInvalidArgument) {
  expectThrows<gradagg::InvalidArgument>([] { BatchPlan(10, 0); }, "batch_size 0");
  expectThrows<gradagg::InvalidArgument>([] { BatchPlan(0, 4); }, "empty");
  expectThrows<gradagg::InvalidArgument>(
      [] {
        BatchPlan(3, 4, {false, 0, true});
      },
      "drop_last with 3 samples");
  expectThrows<gradagg::InvalidArgument>([] { BatchPlan(10, 4).indices(0, 3, 3); },
                                         "worker 3 of 3");
  expectThrows<gradagg::InvalidArgument>([] { BatchPlan(10, 4).epoch(-1); }, "step -1");
}

TEST_F(ShardedBatchesTest, CollatesLikeTorchDataAndGivesZeroRowsToAWorkerWithNone) {
  const Data d = makeData(ModelKind::kMlp, 10, torch::kFloat);
  ShardedBatches<Rows> data(Rows(d.x, d.y), 4);
  ShardContext ctx;
  ctx.global_workers = 3;
  auto batch = data.batch(ctx);
  EXPECT_TRUE(torch::equal(batch.data, d.x.narrow(0, 0, 2)));
  EXPECT_TRUE(torch::equal(batch.target, d.y.narrow(0, 0, 2)));
  ctx.step = 2;
  ctx.global_rank = 2;
  auto none = data.batch(ctx);
  EXPECT_EQ(none.data.sizes(), (std::vector<int64_t>{0, 6}));
  EXPECT_EQ(none.target.sizes(), (std::vector<int64_t>{0}));
  // A dataset that collates itself (.map(Stack<>())) and a TensorDataset.
  ShardedBatches mapped(Rows(d.x, d.y).map(torch::data::transforms::Stack<>()), 4);
  EXPECT_TRUE(torch::equal(mapped.global_batch(1).data, d.x.narrow(0, 4, 4)));
  ShardedBatches tensors(torch::data::datasets::TensorDataset(d.x), 4);
  EXPECT_TRUE(torch::equal(tensors.global_batch(2).data, d.x.narrow(0, 8, 2)));
  expectThrows<gradagg::InvalidArgument>(
      [&] { ShardedBatches<Rows>(Rows(d.x.narrow(0, 0, 0), d.y.narrow(0, 0, 0)), 4); }, "empty");
}

// 17 samples in batches of 8 over two shuffled epochs: 8, 8, 1 per epoch, so
// with 2 and 3 workers the last step of an epoch leaves some with nothing.
constexpr int64_t kSamples = 17, kBatch = 8, kEpochs = 2;

struct Trained {
  std::vector<torch::Tensor> params;
  std::vector<double> losses;
};

Trained oneProcess() {
  auto model = makeModel(ModelKind::kMlp, torch::kDouble);
  torch::optim::SGD opt(model->parameters(), 0.1);
  const Data d = makeData(ModelKind::kMlp, kSamples, torch::kDouble);
  ShardedBatches<Rows> data(Rows(d.x, d.y), kBatch, shuffled(3));
  Trained run;
  for (int64_t s = 0; s < kEpochs * data.steps_per_epoch(); ++s) {
    auto batch = data.global_batch(s);
    opt.zero_grad();
    auto loss = model->loss(model->forward(batch.data), batch.target);
    loss.backward();
    opt.step();
    run.losses.push_back(loss.item<double>());
  }
  run.params = paramsOf(*model);
  return run;
}

// Steps [from, to) with `workers` workers, on `model` and `opt` as they are.
void gradaggSteps(TestModel& model, torch::optim::Optimizer& opt, int workers, int64_t from,
                  int64_t to, ShardedBatchesOptions options, int accumulation, Trained& run) {
  const Data d = makeData(ModelKind::kMlp, kSamples, torch::kDouble);
  ShardedBatches<Rows> data(Rows(d.x, d.y), kBatch, options);
  gradagg::Options o;
  o.workers = workers;
  o.start_step = from;
  o.accumulation_steps = accumulation;
  gradagg::Aggregator agg(
      model,
      [&](const ShardContext& ctx) {
        auto batch = data.batch(ctx);
        return gradagg::ShardResult{model.loss(model.forward(batch.data), batch.target),
                                    batch.data.size(0)};
      },
      o);
  for (int64_t s = from; s < to; ++s) {
    opt.zero_grad();
    run.losses.push_back(agg.step().loss);
    opt.step();
  }
}

class ShardedTraining : public GradaggTest, public ::testing::WithParamInterface<int> {};

TEST_P(ShardedTraining, EqualsOneProcessOverTheSameGlobalBatches) {
  const int workers = GetParam();
  const Trained want = oneProcess();
  auto model = makeModel(ModelKind::kMlp, torch::kDouble);
  torch::optim::SGD opt(model->parameters(), 0.1);
  Trained got;
  gradaggSteps(*model, opt, workers, 0, kEpochs * 3, shuffled(3), 1, got);
  got.params = paramsOf(*model);
  expectClose(got.params, want.params, 1e-12, fmt::format("{} workers", workers));
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (std::size_t s = 0; s < got.losses.size(); ++s)
    EXPECT_NEAR(got.losses[s], want.losses[s], 1e-12) << "step " << s;
}

INSTANTIATE_TEST_SUITE_P(Workers, ShardedTraining, ::testing::Values(1, 2, 3));

// A run stopped in the middle of an epoch and resumed in a fresh Aggregator at
// Options::start_step reads what the run never stopped read: same bits. So do
// runs with prefetching and with gradient accumulation (each micro-batch a part
// of the worker's part).
TEST_F(ShardedBatchesTest, AResumeInTheMiddleOfAnEpochAndPrefetchingChangeNoBit) {
  auto straight = [](ShardedBatchesOptions options, int accumulation) {
    auto model = makeModel(ModelKind::kMlp, torch::kDouble);
    torch::optim::Adam opt(model->parameters(), 0.05);
    Trained run;
    gradaggSteps(*model, opt, 2, 0, kEpochs * 3, options, accumulation, run);
    run.params = paramsOf(*model);
    return run;
  };
  const Trained want = straight(shuffled(5), 1);

  auto model = makeModel(ModelKind::kMlp, torch::kDouble);
  torch::optim::Adam opt(model->parameters(), 0.05);
  Trained resumed;
  gradaggSteps(*model, opt, 2, 0, 4, shuffled(5), 1, resumed);  // stops at step 4 of 6
  gradaggSteps(*model, opt, 2, 4, kEpochs * 3, shuffled(5), 1, resumed);
  EXPECT_TRUE(bitIdentical(paramsOf(*model), want.params)) << "resumed at step 4";
  EXPECT_EQ(resumed.losses, want.losses);

  const Trained prefetched = straight(shuffled(5, true), 1);
  EXPECT_TRUE(bitIdentical(prefetched.params, want.params)) << "prefetch";
  EXPECT_EQ(prefetched.losses, want.losses);

  // Accumulation splits the samples differently: the same up to rounding, and
  // with prefetching (the next micro-batch, then the next step) the same bits.
  const Trained micro = straight(shuffled(5), 2);
  expectClose(micro.params, want.params, 1e-12, "accumulation 2");
  EXPECT_TRUE(bitIdentical(straight(shuffled(5, true), 2).params, micro.params))
      << "accumulation 2 with prefetch";
}

}  // namespace
