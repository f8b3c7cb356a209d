// The user's loop cannot go silently wrong (issue 45): the loops of
// docs/checkpoints.md, as users write them, against the run that never stopped
// and against one process.
//  - a checkpoint's step and data position reach the Aggregator without the
//    user repeating them (or a different start_step is refused);
//  - an epoch left early does not shift the next one (ShardedBatches::steps);
//  - an LR scheduler stepped per epoch resumes bit for bit from every step,
//    epoch boundaries included (the MNIST example's structure: StepLR once an
//    epoch; Adagrad for its Adadelta, which LibTorch 1.13 does not have);
//  - the workers' seeds follow torch's seed, and a one-process reference of a
//    dropout run is built from gradagg::workerSeed;
//  - every worker reading the same batch is said once.
#include <gradagg/data.h>

#include <filesystem>

#include <fmt/format.h>

#include "runtime/temp_dir.h"
#include "support/expect_throws.h"
#include "support/support.h"

namespace gradagg_test {
namespace {

using gradagg::BatchPosition;
using gradagg::Checkpoint;
using gradagg::TrainingState;
using gradagg::detail::TempDir;

using Batches = gradagg::data::ShardedBatches<Rows>;

// A float64 MLP with dropout: every step's masks depend on the workers' seeds.
struct DropoutNet : torch::nn::Module {
  explicit DropoutNet(double dropout = 0.5) {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 2));
    drop = register_module("drop", torch::nn::Dropout(dropout));
    to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2->forward(drop->forward(torch::tanh(fc1->forward(x))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};

// 30 samples in batches of 8: 4 steps an epoch, the last of 6.
Rows rows() {
  auto gen = at::detail::createCPUGenerator(11);
  auto x = torch::randn({30, 6}, gen, torch::kDouble);
  return Rows(x, torch::sin(x.narrow(1, 0, 2)) + 0.1 * x.narrow(1, 2, 2));
}

gradagg::ShardFn shardOf(DropoutNet& net, Batches& data) {
  return [&net, &data](const gradagg::ShardContext& ctx) {
    auto batch = data.batch(ctx);
    if (batch.data.size(0) == 0) return gradagg::ShardResult{{}, 0};
    auto loss = torch::mse_loss(net.forward(batch.data), batch.target);
    return gradagg::ShardResult{loss, batch.data.size(0)};
  };
}

gradagg::Options twoWorkers() {
  gradagg::Options o;
  o.workers = 2;
  return o;
}

// A run of the documented loop: net, optimizer, per-epoch scheduler, data.
struct LoopRun {
  explicit LoopRun(std::uint64_t init_seed = 5) {
    torch::manual_seed(init_seed);
    net = std::make_shared<DropoutNet>();
    opt = std::make_unique<torch::optim::Adagrad>(net->parameters(),
                                                  torch::optim::AdagradOptions(1.0));
    scheduler = std::make_unique<torch::optim::StepLR>(*opt, 1, 0.7);
    torch::manual_seed(1234);  // the program's --seed: the workers' seeds derive from it
  }
  std::shared_ptr<DropoutNet> net;
  std::unique_ptr<torch::optim::Adagrad> opt;
  std::unique_ptr<torch::optim::StepLR> scheduler;
  Batches data{rows(), 8};

  // Trains from `state` to the end of `epochs`, saving after every step into
  // saves[step] when given (a checkpoint at an epoch's last step is taken
  // before the scheduler's step, as the loop is written).
  void train(std::int64_t epochs, const TrainingState& state = {},
             std::vector<std::unique_ptr<Checkpoint>>* saves = nullptr) {
    gradagg::Aggregator agg(*net, shardOf(*net, data), twoWorkers());
    for (auto epoch = state.position.epoch; epoch < epochs; ++epoch) {
      for (const BatchPosition& position : data.steps(epoch, state.position)) {
        opt->zero_grad();
        agg.step(position);
        opt->step();
        if (saves != nullptr) {
          TrainingState now;
          now.step = agg.stepsDone();
          now.position = agg.position();
          (*saves)[static_cast<std::size_t>(now.step)]->save(*net, *opt, now, scheduler.get());
        }
      }
      scheduler->step();
    }
  }
  std::vector<torch::Tensor> params() const { return paramsOf(*net); }
};

class ResumeLoopTest : public GradaggTest {
 protected:
  TempDir dir_{"loop"};
};

TEST_F(ResumeLoopTest, ALoadedCheckpointGivesTheAggregatorItsStepAndPositionWithoutStartStep) {
  LoopRun whole;
  whole.train(2);

  LoopRun first;
  const Checkpoint ckpt(dir_.file("run.ckpt"));
  {
    gradagg::Aggregator agg(*first.net, shardOf(*first.net, first.data), twoWorkers());
    for (const BatchPosition& p : first.data.steps(0)) {
      first.opt->zero_grad();
      agg.step(p);
      first.opt->step();
    }
    first.scheduler->step();
    first.opt->zero_grad();
    agg.step(first.data.steps(1).front());
    first.opt->step();
    TrainingState state;
    state.step = agg.stepsDone();
    state.position = agg.position();
    ckpt.save(*first.net, *first.opt, state, first.scheduler.get());
  }

  LoopRun resumed(/*init_seed=*/99);  // other initial values: the checkpoint overwrites them
  const TrainingState state = ckpt.load(*resumed.net, *resumed.opt, {}, resumed.scheduler.get());
  EXPECT_EQ(state.step, 5);
  EXPECT_EQ(state.position, (BatchPosition{1, 1}));
  {
    // The note is the model's: given another start_step, the Aggregator refuses.
    gradagg::Options wrong = twoWorkers();
    wrong.start_step = 3;
    expectThrows<gradagg::InvalidArgument>(
        [&] { gradagg::Aggregator(*resumed.net, shardOf(*resumed.net, resumed.data), wrong); },
        "loaded from checkpoint");
  }
  {  // the refused one changed nothing: the next one still goes on from the checkpoint
    gradagg::Aggregator agg(*resumed.net, shardOf(*resumed.net, resumed.data), twoWorkers());
    EXPECT_EQ(agg.stepsDone(), 5) << "the Aggregator took the checkpoint's step";
    EXPECT_EQ(agg.position(), (BatchPosition{1, 1}));
    // A batch before the checkpoint's position is refused, before anything runs.
    expectThrows<gradagg::InvalidArgument>(
        [&] {
          agg.step(BatchPosition{1, 0});
        },
        "a batch is trained once");
  }
  ckpt.load(*resumed.net, *resumed.opt, {}, resumed.scheduler.get());
  resumed.train(2, state);
  EXPECT_TRUE(bitIdentical(resumed.params(), whole.params()));
}

TEST_F(ResumeLoopTest, ALoadIntoTheModelOfALiveAggregatorSetsItsStepAndPosition) {
  LoopRun run;
  const Checkpoint ckpt(dir_.file("run.ckpt"));
  gradagg::Aggregator agg(*run.net, shardOf(*run.net, run.data), twoWorkers());
  for (int i = 0; i < 3; ++i) agg.step(run.data.steps(0)[static_cast<std::size_t>(i)]);
  TrainingState state;
  state.step = agg.stepsDone();
  state.position = agg.position();
  ckpt.save(*run.net, *run.opt, state);
  agg.step(BatchPosition{0, 3});
  agg.step(BatchPosition{1, 0});
  EXPECT_EQ(agg.stepsDone(), 5);
  ckpt.load(*run.net, *run.opt, {});  // back to step 3, before batch 3 of epoch 0
  EXPECT_EQ(agg.stepsDone(), 3);
  EXPECT_EQ(agg.position(), (BatchPosition{0, 3}));
  EXPECT_EQ(agg.step(BatchPosition{0, 3}).step, 3);
  EXPECT_EQ(agg.stepsDone(), 4);
  EXPECT_EQ(agg.position(), (BatchPosition{0, 4}));
}

TEST_F(ResumeLoopTest, ALoadThatCannotBeTheRunIsRefusedAndWeightsAloneAreNoResume) {
  LoopRun run;
  const Checkpoint ckpt(dir_.file("run.ckpt"));
  TrainingState state;
  {
    gradagg::Aggregator agg(*run.net, shardOf(*run.net, run.data), twoWorkers());
    for (int i = 0; i < 3; ++i) agg.step(run.data.steps(0)[static_cast<std::size_t>(i)]);
    state.step = agg.stepsDone();
    state.position = agg.position();
    ckpt.save(*run.net, *run.opt, state);
    TrainingState no_position;
    no_position.step = agg.stepsDone();
    const Checkpoint bare(dir_.file("bare.ckpt"));
    bare.save(*run.net, *run.opt, no_position);
    bare.wait();
    // Saved without the position: step(position) cannot know what that run trained.
    LoopRun other;
    bare.load(*other.net, *other.opt, {});
    gradagg::Aggregator resumed(*other.net, shardOf(*other.net, other.data), twoWorkers());
    EXPECT_EQ(resumed.stepsDone(), 3);
    expectThrows<gradagg::InvalidArgument>(
        [&] {
          resumed.step(BatchPosition{0, 3});
        },
        "saved without the data's position");
  }
  {  // Weights alone (no optimizer) initialise; they are not a resume.
    LoopRun fine_tune;
    ckpt.load(gradagg::viewOf(*fine_tune.net), nullptr, {});
    gradagg::Aggregator agg(*fine_tune.net, shardOf(*fine_tune.net, fine_tune.data), twoWorkers());
    EXPECT_EQ(agg.stepsDone(), 0);
    EXPECT_EQ(agg.position(), BatchPosition{});
  }
  {  // An Aggregator whose workers' seed is another torch seed than the checkpoint's.
    LoopRun late;
    torch::manual_seed(4321);
    gradagg::Aggregator agg(*late.net, shardOf(*late.net, late.data), twoWorkers());
    ckpt.load(*late.net, *late.opt, {});  // restores torch's generator: seed 1234
    expectThrows<gradagg::InvalidArgument>(
        [&] {
          agg.step(BatchPosition{0, 3});
        },
        "make the Aggregator after the load");
    EXPECT_EQ(agg.stepsDone(), 0) << "the refused load changed nothing";
  }
}

TEST_F(ResumeLoopTest, AnEpochLeftEarlyDoesNotShiftTheNextOne) {
  const BatchPosition none{0, 0};
  Batches data(rows(), 8);
  EXPECT_EQ(data.steps(0).size(), 4u);
  EXPECT_EQ(data.steps(1, BatchPosition{1, 3}), (std::vector<BatchPosition>{{1, 3}}));
  EXPECT_TRUE(data.steps(0, BatchPosition{1, 0}).empty()) << "an epoch the run had done";
  EXPECT_EQ(data.steps(2, BatchPosition{1, 2}).size(), 4u);
  EXPECT_EQ(data.steps(1, BatchPosition{1, 4}).size(), 0u) << "a checkpoint at the epoch's end";
  (void)none;

  // Training: epoch 0 left after 2 of its 4 batches (the original's `break`),
  // then epoch 1 whole; no dropout, so one process over the same global
  // batches is the reference.
  torch::manual_seed(5);
  auto net = std::make_shared<DropoutNet>(0.0);
  torch::manual_seed(5);
  auto ref = std::make_shared<DropoutNet>(0.0);
  torch::optim::SGD opt(net->parameters(), 0.1), ref_opt(ref->parameters(), 0.1);
  std::vector<BatchPosition> trained;
  {
    gradagg::Aggregator agg(*net, shardOf(*net, data), twoWorkers());
    for (std::int64_t epoch = 0; epoch < 2; ++epoch) {
      for (const BatchPosition& p : data.steps(epoch)) {
        if (epoch == 0 && p.index == 2) break;
        opt.zero_grad();
        agg.step(p);
        opt.step();
        trained.push_back(p);
      }
    }
  }
  ASSERT_EQ(trained.size(), 6u);
  for (const BatchPosition& p : trained) {
    auto batch = data.global_batch(p);
    ref_opt.zero_grad();
    torch::mse_loss(ref->forward(batch.data), batch.target).backward();
    ref_opt.step();
  }
  expectClose(paramsOf(*net), paramsOf(*ref), 1e-12, "epoch 1 after a shortened epoch 0");
  // The index outside an epoch is named.
  expectThrows<gradagg::InvalidArgument>(
      [&] {
        data.global_batch(BatchPosition{0, 4});
      },
      "batch 4 of epoch 0");
}

TEST_F(ResumeLoopTest, APerEpochSchedulerResumesBitForBitFromEveryStepEpochEndsIncluded) {
  constexpr std::int64_t kEpochs = 3;
  LoopRun whole;
  std::vector<std::unique_ptr<Checkpoint>> saves;
  for (int s = 0; s <= 12; ++s)
    saves.push_back(std::make_unique<Checkpoint>(dir_.file(fmt::format("step{}.ckpt", s))));
  whole.train(kEpochs, {}, &saves);
  for (std::size_t s = 1; s <= 12; ++s) {
    LoopRun resumed(/*init_seed=*/99);
    const TrainingState state =
        saves[s]->load(*resumed.net, *resumed.opt, {}, resumed.scheduler.get());
    ASSERT_EQ(state.step, static_cast<std::int64_t>(s));
    resumed.train(kEpochs, state);
    EXPECT_TRUE(bitIdentical(resumed.params(), whole.params()))
        << "resumed from step " << s << " (epoch " << state.position.epoch << ", batch "
        << state.position.index << ")";
    EXPECT_EQ(resumed.opt->param_groups()[0].options().get_lr(),
              whole.opt->param_groups()[0].options().get_lr());
  }
  // A scheduler asked of a checkpoint saved without one is named.
  const Checkpoint bare(dir_.file("bare.ckpt"));
  bare.save(*whole.net, *whole.opt, TrainingState{});
  LoopRun other;
  expectThrows<gradagg::CheckpointError>(
      [&] { bare.load(*other.net, *other.opt, {}, other.scheduler.get()); }, "no scheduler");
}

// The gradient of worker r's part of step 0 in one process, with the generator
// seeded as gradagg seeds worker r.
std::vector<torch::Tensor> referenceGradient(DropoutNet& net, Batches& data, std::uint64_t seed,
                                             int workers) {
  std::vector<torch::Tensor> sum;
  std::int64_t total = 0;
  for (int r = 0; r < workers; ++r) {
    gradagg::ShardContext ctx;
    ctx.global_rank = r;
    ctx.global_workers = workers;
    auto batch = data.batch(ctx);
    torch::manual_seed(gradagg::workerSeed(seed, r, /*step=*/0));
    net.zero_grad();
    torch::mse_loss(net.forward(batch.data), batch.target).backward();
    const auto n = batch.data.size(0);
    total += n;
    const auto grads = gradsOf(net);
    for (std::size_t k = 0; k < grads.size(); ++k) {
      auto weighted = grads[k] * static_cast<double>(n);
      if (sum.size() <= k)
        sum.push_back(weighted);
      else
        sum[k] += weighted;
    }
  }
  for (auto& g : sum) g /= static_cast<double>(total);
  return sum;
}

TEST_F(ResumeLoopTest, TheWorkersSeedsFollowTorchsSeedAndBuildTheOneProcessReference) {
  Batches data(rows(), 8);
  auto gradientWith = [&](std::uint64_t seed) {
    torch::manual_seed(5);
    DropoutNet net;
    torch::manual_seed(seed);  // the program's --seed, after the model was made
    gradagg::Aggregator agg(net, shardOf(net, data), twoWorkers());
    EXPECT_EQ(*agg.options().seed, seed);
    agg.step();
    return gradsOf(net);
  };
  const auto one = gradientWith(1), again = gradientWith(1), two = gradientWith(2);
  EXPECT_TRUE(bitIdentical(one, again));
  EXPECT_FALSE(bitIdentical(one, two)) << "torch::manual_seed changed nothing in the workers";

  torch::manual_seed(5);
  DropoutNet ref;
  expectClose(one, referenceGradient(ref, data, 1, 2), 1e-12,
              "one process seeded with gradagg::workerSeed");
}

TEST_F(ResumeLoopTest, EveryWorkerReadingTheSameBatchIsSaidOnce) {
  Batches data(rows(), 8);
  torch::manual_seed(5);
  DropoutNet net(0.0);
  auto same = [&](const gradagg::ShardContext&) {  // a parent's iterator: the same rows
    auto batch = data.global_batch(0);
    return gradagg::ShardResult{torch::mse_loss(net.forward(batch.data), batch.target),
                                batch.data.size(0)};
  };
  const std::string warning = "every worker's gradient was the same";
  testing::internal::CaptureStderr();
  {
    gradagg::Aggregator agg(net, same, twoWorkers());
    for (int s = 0; s < 3; ++s) agg.step();
  }
  const std::string said = testing::internal::GetCapturedStderr();
  const auto first = said.find(warning);
  EXPECT_NE(first, std::string::npos) << said;
  EXPECT_EQ(said.find(warning, first + 1), std::string::npos) << "said more than once: " << said;

  testing::internal::CaptureStderr();
  {
    gradagg::Aggregator agg(net, shardOf(net, data), twoWorkers());
    for (const BatchPosition& p : data.steps(0)) agg.step(p);
  }
  EXPECT_EQ(testing::internal::GetCapturedStderr().find(warning), std::string::npos);
}

}  // namespace
}  // namespace gradagg_test
