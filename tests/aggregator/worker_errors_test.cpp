// One worker goes wrong in a step: its shard function throws or returns something
// unusable, it writes the read-only snapshot, it is killed, it is late, its gradient
// is not finite. The error names the worker (and phase, signal, parameter), nothing
// is applied, and the aggregator stays usable or not as include/gradagg/errors.h says.
#include <cmath>
#include <csignal>
#include <set>
#include <stdexcept>
#include <thread>

#include "behaviour.h"
#include "support/expect_throws.h"

namespace gradagg_test {
namespace {

using namespace std::chrono_literals;

TEST_F(Behaviour, ShardExceptionRaisesWorkerFailedAndTheAggregatorStaysUsable) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 12, torch::kFloat);
  auto inner = shardFn(*model, data, shardBounds(12, 3, false));
  // Worker state persists across steps: count the calls in the worker.
  gradagg::Aggregator agg(
      *model,
      [&, calls = 0](const gradagg::ShardContext& c) mutable {
        if (c.rank == 1 && ++calls == 2) throw std::runtime_error("bad record in shard 1");
        return inner(c);
      },
      opts(3));
  agg.step();
  const auto grads = gradsOf(*model);
  const auto params = model->parameters();
  if (const auto e = expectThrows<gradagg::WorkerFailed>([&] { agg.step(); }, "worker 1")) {
    EXPECT_EQ(e->rank(), 1);
    EXPECT_EQ(e->phase(), gradagg::Phase::kShard);
    EXPECT_EQ(e->message(), "bad record in shard 1");
  }
  // Nothing was applied: .grad is still the previous step's.
  expectClose(gradsOf(*model), grads, 0, "grads after a failed step");
  EXPECT_TRUE(agg.usable());
  // The failed step was not applied, so the retry is step 1 again.
  EXPECT_EQ(agg.stepsDone(), 1);
  EXPECT_EQ(agg.step().step, 1);
}

TEST_F(Behaviour, NonPositiveSampleCountIsAWorkerFailedNamingTheField) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y),
                                    c.rank == 1 ? -1 : 2};
      },
      opts(2));
  if (const auto e = expectThrows<gradagg::WorkerFailed>([&] { agg.step(); })) {
    EXPECT_EQ(e->rank(), 1);
    EXPECT_NE(e->message().find("samples"), std::string::npos) << e->message();
  }
}

TEST_F(Behaviour, LossThatDoesNotRequireGradIsAWorkerFailed) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext&) {
        torch::NoGradGuard no_grad;
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
      },
      opts(1));
  EXPECT_THROW(agg.step(), gradagg::WorkerFailed);
  EXPECT_TRUE(agg.usable());
}

TEST_F(Behaviour, ReplacingAParameterInTheReplicaIsReportedByName) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(
      *model,
      [&, calls = 0](const gradagg::ShardContext&) mutable {
        if (++calls == 1) model->named_parameters()["bias"].set_data(torch::zeros({1}));
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
      },
      opts(1));
  if (const auto e = expectThrows<gradagg::WorkerFailed>([&] { agg.step(); })) {
    EXPECT_NE(e->message().find("'bias'"), std::string::npos) << e->message();
  }
  // The replica was put back: the next step works and matches the reference.
  const auto want = fullBatchGrads(*model, data);
  agg.step();
  expectClose(gradsOf(*model), want, 1e-6, "after the repaired step");
}

TEST_F(Behaviour, WritingAParameterInAWorkerKillsItWithSigsegvAndIsReported) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  const auto before = model->parameters()[0].detach().clone();
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        if (c.rank == 1) {
          torch::NoGradGuard no_grad;
          model->parameters()[0].add_(1.0);  // the snapshot is read-only in workers
        }
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
      },
      opts(2));
  if (const auto e = expectThrows<gradagg::WorkerDied>([&] { agg.step(); })) {
    EXPECT_EQ(e->rank(), 1);
    EXPECT_EQ(e->signal(), SIGSEGV);
    EXPECT_EQ(e->phase(), gradagg::Phase::kShard);
  }
  EXPECT_TRUE(torch::equal(model->parameters()[0], before));
  EXPECT_FALSE(agg.usable());
  EXPECT_THROW(agg.step(), gradagg::NotUsable);
}

TEST_F(Behaviour, KilledWorkerRaisesWorkerDiedNamingRankPhaseAndSignal) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 12, torch::kFloat);
  auto inner = shardFn(*model, data, shardBounds(12, 3, false));
  auto optimizer = torch::optim::SGD(model->parameters(), 0.1);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        if (c.rank == 2 && c.step == 1) ::raise(SIGKILL);
        return inner(c);
      },
      opts(3));
  agg.step();
  optimizer.step();
  std::vector<torch::Tensor> params;
  for (auto& p : model->parameters()) params.push_back(p.detach().clone());
  const auto t0 = std::chrono::steady_clock::now();
  if (const auto e = expectThrows<gradagg::WorkerDied>([&] { agg.step(); }, "signal 9")) {
    EXPECT_EQ(e->rank(), 2);
    EXPECT_EQ(e->signal(), SIGKILL);
    EXPECT_EQ(e->phase(), gradagg::Phase::kShard);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  for (size_t k = 0; k < params.size(); ++k)
    EXPECT_TRUE(torch::equal(model->parameters()[k], params[k]));
  EXPECT_TRUE(childPids().empty()) << "the other workers were not reaped";
  EXPECT_THROW(agg.step(), gradagg::NotUsable);
}

TEST_F(Behaviour, LateWorkerRaisesStepTimeoutNamingItsRank) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  auto o = opts(2);
  o.step_timeout = 300ms;
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        if (c.rank == 1) std::this_thread::sleep_for(30s);
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
      },
      o);
  const auto t0 = std::chrono::steady_clock::now();
  if (const auto e = expectThrows<gradagg::StepTimeout>([&] { agg.step(); })) {
    EXPECT_EQ(e->rank(), 1);
    EXPECT_EQ(e->phase(), gradagg::Phase::kShard);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_FALSE(agg.usable());
}

gradagg::ShardFn poisonAt(TestModel& model, const Data& data, int rank, std::set<int64_t> steps) {
  auto inner = shardFn(model, data, shardBounds(data.x.size(0), 2, false));
  return [=](const gradagg::ShardContext& c) {
    auto r = inner(c);
    if (c.rank == rank && steps.count(c.step)) r.loss = r.loss * std::nan("");
    return r;
  };
}

TEST_F(GradaggTest, NonFiniteGradientRaisesNamingRankAndParameterByDefault) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Options o;
  o.workers = 2;
  gradagg::Aggregator agg(*model, poisonAt(*model, data, 1, {1}), o);
  agg.step();
  const auto params = paramsOf(*model);
  const auto grads = gradsOf(*model);
  if (const auto e = expectThrows<gradagg::NonFiniteGradient>([&] { agg.step(); }, "'theta'")) {
    EXPECT_EQ(e->rank(), 1);
    EXPECT_EQ(e->parameter(), "theta") << e->what();
  }
  EXPECT_TRUE(bitIdentical(paramsOf(*model), params));
  expectClose(gradsOf(*model), grads, 0, ".grad after the refused step");
  EXPECT_TRUE(agg.usable());
}

TEST_F(GradaggTest, NonFiniteGradientSkipsTheStepThenAbortsAfterTooManyInARow) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  gradagg::Options o;
  o.workers = 2;
  o.non_finite = gradagg::NonFinitePolicy::kSkipStep;
  o.max_consecutive_skips = 2;
  gradagg::Aggregator agg(*model, poisonAt(*model, data, 0, {1, 3, 4, 5}), o);
  EXPECT_FALSE(agg.step().skipped);  // step 0
  sgd.step();
  auto params = paramsOf(*model);
  const auto& r1 = agg.step();  // step 1: skipped
  EXPECT_TRUE(r1.skipped);
  EXPECT_EQ(r1.consecutive_skips, 1);
  for (auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
  sgd.step();
  EXPECT_TRUE(bitIdentical(paramsOf(*model), params)) << "a skipped step changed parameters";
  EXPECT_FALSE(agg.step().skipped);  // step 2
  sgd.step();
  EXPECT_TRUE(agg.step().skipped);                       // 3
  EXPECT_EQ(agg.step().consecutive_skips, 2);            // 4
  EXPECT_THROW(agg.step(), gradagg::NonFiniteGradient);  // 5: a third in a row
  EXPECT_EQ(agg.stepsDone(), 5);
}

}  // namespace
}  // namespace gradagg_test
