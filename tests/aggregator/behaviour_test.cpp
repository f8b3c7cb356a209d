// What users see beyond the plain mean gradient: unused and frozen parameters,
// buffers, training mode, errors from workers, deadlines, fork safety, options.
#include <sys/wait.h>

#include <csignal>
#include <thread>

#include <ATen/Parallel.h>

#include "support/expect_throws.h"
#include "support/support.h"

namespace gradagg_test {
namespace {

using namespace std::chrono_literals;

gradagg::Options opts(int workers) {
  gradagg::Options o;
  o.workers = workers;
  o.step_timeout = 60s;
  return o;
}

// y = a * x (+ b * x only where a rank asks for it), plus a parameter nobody uses.
struct TwoParam : torch::nn::Module {
  TwoParam() {
    a = register_parameter("a", torch::full({3}, 0.5));
    b = register_parameter("b", torch::full({3}, -0.25));
    spare = register_parameter("spare", torch::zeros({2}));
  }
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y, bool use_b) {
    auto out = (a * x).sum(1);
    if (use_b) out = out + (b * x).sum(1);
    return torch::mse_loss(out, y);
  }
  torch::Tensor a, b, spare;
};

class Behaviour : public GradaggTest {};

TEST_F(Behaviour, UnusedParameterKeepsGradUndefinedLikeAutograd) {
  TwoParam m;
  const auto x = torch::randn({8, 3}), y = torch::randn({8});
  gradagg::Aggregator agg(m, [&](const gradagg::ShardContext& c) {
    auto xs = x.slice(0, 4 * c.rank, 4 * c.rank + 4), ys = y.slice(0, 4 * c.rank, 4 * c.rank + 4);
    return gradagg::ShardResult{m.loss(xs, ys, true), 4};
  }, opts(2));
  agg.step();
  EXPECT_TRUE(m.a.grad().defined());
  EXPECT_TRUE(m.b.grad().defined());
  EXPECT_FALSE(m.spare.grad().defined()) << "no worker produced a gradient for 'spare'";
}

TEST_F(Behaviour, ParameterUsedBySomeWorkersIsAveragedOverAllSamples) {
  TwoParam m;
  const auto x = torch::randn({9, 3}, torch::kDouble), y = torch::randn({9}, torch::kDouble);
  m.to(torch::kDouble);
  const std::vector<int64_t> bounds{0, 2, 5, 9};
  auto shard = [&](torch::nn::Module&, int r) {
    return m.loss(x.slice(0, bounds[r], bounds[r + 1]), y.slice(0, bounds[r], bounds[r + 1]),
                  /*use_b=*/r == 0);
  };
  // Reference: one process, the full-batch mean over every sample: shard 0's
  // samples use b, the others do not.
  TwoParam ref;
  ref.to(torch::kDouble);
  torch::Tensor total;
  for (int r = 0; r < 3; ++r) {
    auto l = ref.loss(x.slice(0, bounds[r], bounds[r + 1]), y.slice(0, bounds[r], bounds[r + 1]),
                      r == 0) *
             (double(bounds[r + 1] - bounds[r]) / 9);
    total = total.defined() ? total + l : l;
  }
  total.backward();

  gradagg::Aggregator agg(m, [&](const gradagg::ShardContext& c) {
    return gradagg::ShardResult{shard(m, c.rank), bounds[c.rank + 1] - bounds[c.rank]};
  }, opts(3));
  agg.step();
  ASSERT_TRUE(m.b.grad().defined());
  EXPECT_LE(relErr(m.a.grad(), ref.a.grad()), 1e-12);
  EXPECT_LE(relErr(m.b.grad(), ref.b.grad()), 1e-12);
}

TEST_F(Behaviour, FrozenParameterGetsNoGradAndKeepsItsValue) {
  auto model = makeModel(ModelKind::kMlp, torch::kDouble);
  auto frozen = model->named_parameters()["fc1.bias"];
  frozen.set_requires_grad(false);
  const auto before = frozen.detach().clone();
  const Data data = makeData(ModelKind::kMlp, 12, torch::kDouble);
  const auto want = fullBatchGrads(*model, data);
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(12, 2, false)), opts(2));
  agg.step();
  EXPECT_FALSE(frozen.grad().defined());
  expectClose(gradsOf(*model), want, 1e-12, "frozen fc1.bias");
  EXPECT_TRUE(torch::equal(frozen, before));
}

TEST_F(Behaviour, EqualWeightingIsTheMeanOfShardGradients) {
  auto model = makeModel(ModelKind::kMlp, torch::kDouble);
  const Data data = makeData(ModelKind::kMlp, 20, torch::kDouble);
  const auto bounds = shardBounds(20, 3, /*unequal=*/true);
  const auto want = perShardGrads(*model, data, bounds, /*by_samples=*/false);
  auto o = opts(3);
  o.weighting = gradagg::Weighting::kEqual;
  gradagg::Aggregator agg(*model, shardFn(*model, data, bounds), o);
  agg.step();
  expectClose(gradsOf(*model), want, 1e-12, "equal weighting");
  // And it differs from the sample-weighted mean, so the test can tell them apart.
  const auto by_samples = fullBatchGrads(*model, data);
  EXPECT_GT(relErr(gradsOf(*model)[0], by_samples[0]), 1e-6);
}

TEST_F(Behaviour, WorkersSeeTheParentsBuffersAndTrainingModeEachStep) {
  auto model = makeModel(ModelKind::kConvBnTrain, torch::kDouble);
  const Data data = makeData(ModelKind::kConvBnTrain, 16, torch::kDouble);
  auto o = opts(2);
  o.buffers = gradagg::BufferSync::kKeepParent;
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(16, 2, false)), o);
  agg.step();
  // Evaluation mode uses the running statistics: change them in the parent and
  // the workers' gradient must follow.
  model->eval();
  {
    torch::NoGradGuard no_grad;
    for (auto& b : model->named_buffers())
      if (b.key().find("running_mean") != std::string::npos) b.value().fill_(0.75);
  }
  const auto want = fullBatchGrads(*model, data);
  agg.step();
  expectClose(gradsOf(*model), want, 1e-12, "eval mode with new running_mean");
}

std::map<std::string, torch::Tensor> buffersOf(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (auto& b : m.named_buffers()) out[b.key()] = b.value().clone();
  return out;
}

// What worker r's buffers are after its forward, computed in one process.
std::map<std::string, torch::Tensor> shardBuffers(TestModel& model, const Data& data,
                                                  const std::vector<int64_t>& bounds, int r) {
  auto ref = copyModel(model);
  ref->forward(data.x.slice(0, bounds[r], bounds[r + 1]));
  return buffersOf(*ref);
}

class BufferSyncTest : public GradaggTest,
                       public ::testing::WithParamInterface<gradagg::BufferSync> {};

TEST_P(BufferSyncTest, ParentBuffersAfterAStepFollowThePolicy) {
  auto model = makeModel(ModelKind::kConvBnTrain, torch::kDouble);
  const Data data = makeData(ModelKind::kConvBnTrain, 18, torch::kDouble);
  const auto bounds = shardBounds(18, 3, true);
  const auto before = buffersOf(*model);
  std::vector<std::map<std::string, torch::Tensor>> per_rank;
  for (int r = 0; r < 3; ++r) per_rank.push_back(shardBuffers(*model, data, bounds, r));

  auto o = opts(3);
  o.buffers = GetParam();
  gradagg::Aggregator agg(*model, shardFn(*model, data, bounds), o);
  agg.step();
  for (const auto& [name, value] : buffersOf(*model)) {
    torch::Tensor want;
    switch (GetParam()) {
      case gradagg::BufferSync::kKeepParent: want = before.at(name); break;
      case gradagg::BufferSync::kFromRank0: want = per_rank[0].at(name); break;
      case gradagg::BufferSync::kMean:
        if (!value.is_floating_point()) {
          want = per_rank[0].at(name);
          break;
        }
        want = torch::zeros_like(value);
        for (int r = 0; r < 3; ++r)
          want = want + per_rank[r].at(name) * (double(bounds[r + 1] - bounds[r]) / 18);
        break;
    }
    if (value.is_floating_point())
      EXPECT_LE(relErr(value, want), 1e-12) << name;
    else
      EXPECT_TRUE(torch::equal(value, want)) << name;
  }
  if (GetParam() != gradagg::BufferSync::kKeepParent)
    EXPECT_FALSE(torch::equal(buffersOf(*model).at("bn.running_mean"), before.at("bn.running_mean")));
}

INSTANTIATE_TEST_SUITE_P(Policies, BufferSyncTest,
                         ::testing::Values(gradagg::BufferSync::kFromRank0,
                                           gradagg::BufferSync::kMean,
                                           gradagg::BufferSync::kKeepParent),
                         [](const auto& info) {
                           switch (info.param) {
                             case gradagg::BufferSync::kFromRank0: return "FromRank0";
                             case gradagg::BufferSync::kMean: return "Mean";
                             default: return "KeepParent";
                           }
                         });

TEST_F(Behaviour, ShardFunctionIsToldItsRankWorkerCountAndStep) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(*model, [&](const gradagg::ShardContext& c) {
    auto loss = model->loss(model->forward(data.x), data.y);
    return gradagg::ShardResult{loss, 1000 * c.workers + 100 * c.rank + c.step + 1};
  }, opts(3));
  for (int64_t s = 0; s < 3; ++s) {
    const auto& report = agg.step();
    EXPECT_EQ(report.step, s);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(report.workers[r].samples, 3000 + 100 * r + s + 1);
  }
}

// Worker r's draw from LibTorch's default generator in step s, as a sample count.
std::vector<int64_t> randomDraws(bool seed_workers, int steps) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  auto o = opts(3);
  o.seed_workers = seed_workers;
  gradagg::Aggregator agg(*model, [&](const gradagg::ShardContext&) {
    const int64_t draw = 1 + static_cast<int64_t>(torch::rand({1}).item<double>() * 1e9);
    return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), draw};
  }, o);
  std::vector<int64_t> out;
  for (int s = 0; s < steps; ++s)
    for (const auto& w : agg.step().workers) out.push_back(w.samples);
  return out;
}

TEST_F(Behaviour, WorkersDrawDifferentRandomNumbersReproducibly) {
  const auto first = randomDraws(true, 2), second = randomDraws(true, 2);
  EXPECT_EQ(first, second) << "seeded from (seed, rank, step): the same in two runs";
  EXPECT_NE(first[0], first[1]) << "workers 0 and 1 drew the same number";
  EXPECT_NE(first[1], first[2]);
  EXPECT_NE(first[0], first[3]) << "steps 0 and 1 drew the same number";
  // Unseeded, every worker continues the stream it inherited: all draw alike.
  const auto inherited = randomDraws(false, 1);
  EXPECT_EQ(inherited[0], inherited[1]);
}

TEST_F(Behaviour, ReportGivesLossSamplesAndPhaseTimes) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 10, torch::kFloat);
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(10, 2, true)), opts(2));
  const auto& r = agg.step();
  EXPECT_EQ(r.samples, 10);
  ASSERT_EQ(r.workers.size(), 2u);
  EXPECT_GT(r.workers[0].shard_ms, 0);
  EXPECT_GT(r.workers[1].backward_ms, 0);
  EXPECT_GT(r.compute_ms, 0);
  EXPECT_GE(r.total_ms, r.publish_ms + r.compute_ms + r.apply_ms - 1e-9);
  EXPECT_LE(r.reduce_ms, r.compute_ms);  // the workers reduce inside the compute phase
  for (const auto& w : r.workers) {
    EXPECT_GE(w.wake_ms, 0);
    EXPECT_GT(w.load_ms + w.write_ms + w.reduce_ms, 0);
    EXPECT_LE(w.shard_ms + w.backward_ms + w.barrier_ms, r.compute_ms + 1e-9);
  }
  const double mean = (r.workers[0].loss * r.workers[0].samples +
                       r.workers[1].loss * r.workers[1].samples) / 10;
  EXPECT_NEAR(r.loss, mean, 1e-6);
}

TEST_F(Behaviour, ShardExceptionRaisesWorkerFailedAndTheAggregatorStaysUsable) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 12, torch::kFloat);
  auto inner = shardFn(*model, data, shardBounds(12, 3, false));
  // Worker state persists across steps: count the calls in the worker.
  gradagg::Aggregator agg(*model, [&, calls = 0](const gradagg::ShardContext& c) mutable {
    if (c.rank == 1 && ++calls == 2) throw std::runtime_error("bad record in shard 1");
    return inner(c);
  }, opts(3));
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
  gradagg::Aggregator agg(*model, [&](const gradagg::ShardContext& c) {
    return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), c.rank == 1 ? 0 : 2};
  }, opts(2));
  if (const auto e = expectThrows<gradagg::WorkerFailed>([&] { agg.step(); })) {
    EXPECT_EQ(e->rank(), 1);
    EXPECT_NE(e->message().find("samples"), std::string::npos) << e->message();
  }
}

TEST_F(Behaviour, LossThatDoesNotRequireGradIsAWorkerFailed) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(*model, [&](const gradagg::ShardContext&) {
    torch::NoGradGuard no_grad;
    return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
  }, opts(1));
  EXPECT_THROW(agg.step(), gradagg::WorkerFailed);
  EXPECT_TRUE(agg.usable());
}

TEST_F(Behaviour, ReplacingAParameterInTheReplicaIsReportedByName) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(*model, [&, calls = 0](const gradagg::ShardContext&) mutable {
    if (++calls == 1) model->named_parameters()["bias"].set_data(torch::zeros({1}));
    return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
  }, opts(1));
  if (const auto e = expectThrows<gradagg::WorkerFailed>([&] { agg.step(); }))
    EXPECT_NE(e->message().find("'bias'"), std::string::npos) << e->message();
  // The replica was put back: the next step works and matches the reference.
  const auto want = fullBatchGrads(*model, data);
  agg.step();
  expectClose(gradsOf(*model), want, 1e-6, "after the repaired step");
}

TEST_F(Behaviour, WritingAParameterInAWorkerKillsItWithSigsegvAndIsReported) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  const auto before = model->parameters()[0].detach().clone();
  gradagg::Aggregator agg(*model, [&](const gradagg::ShardContext& c) {
    if (c.rank == 1) {
      torch::NoGradGuard no_grad;
      model->parameters()[0].add_(1.0);  // the snapshot is read-only in workers
    }
    return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
  }, opts(2));
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
  gradagg::Aggregator agg(*model, [&](const gradagg::ShardContext& c) {
    if (c.rank == 2 && c.step == 1) ::raise(SIGKILL);
    return inner(c);
  }, opts(3));
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
  gradagg::Aggregator agg(*model, [&](const gradagg::ShardContext& c) {
    if (c.rank == 1) std::this_thread::sleep_for(30s);
    return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
  }, o);
  const auto t0 = std::chrono::steady_clock::now();
  if (const auto e = expectThrows<gradagg::StepTimeout>([&] { agg.step(); })) {
    EXPECT_EQ(e->rank(), 1);
    EXPECT_EQ(e->phase(), gradagg::Phase::kShard);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_FALSE(agg.usable());
}

TEST_F(Behaviour, ForkAfterMultithreadedWorkGivesWorkingMultithreadedWorkers) {
  // libgomp: a parent that ran parallel regions, then forked, used to hang a
  // child's next parallel region. Run parallel work first, then ask for 2 threads.
  at::set_num_threads(2);
  auto a = torch::randn({256, 256});
  for (int i = 0; i < 4; ++i) a = torch::tanh(a.mm(a) / 256);
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kFloat);
  auto inner = shardFn(*model, data, shardBounds(8, 2, false));
  auto o = opts(2);
  o.threads_per_worker = 2;
  o.step_timeout = 30s;  // a hang becomes a StepTimeout, not a stuck test
  gradagg::Aggregator agg(*model, [&](const gradagg::ShardContext& c) {
    if (at::get_num_threads() != 2) throw std::runtime_error("worker does not have 2 threads");
    auto b = torch::randn({256, 256});
    for (int i = 0; i < 4; ++i) b = torch::tanh(b.mm(b) / 256);  // parallel regions
    return inner(c);
  }, o);
  EXPECT_NO_THROW(agg.step());
  EXPECT_NO_THROW(agg.step());
}

TEST_F(Behaviour, DefaultThreadsPerWorkerSplitsTheCores) {
  gradagg::Options o;
  for (int n : {1, 2, 3, 8}) {
    o.workers = n;
    EXPECT_EQ(o.resolvedThreadsPerWorker(), std::max(1, gradagg::availableCores() / n));
  }
  o.threads_per_worker = 3;
  EXPECT_EQ(o.resolvedThreadsPerWorker(), 3);
}

TEST_F(Behaviour, BadOptionsAreInvalidArgumentsNamingTheField) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  auto noop = [](const gradagg::ShardContext&) { return gradagg::ShardResult{}; };
  auto expectField = [&](const gradagg::Options& o, const std::string& field) {
    expectThrows<gradagg::InvalidArgument>([&] { gradagg::Aggregator agg(*model, noop, o); }, field);
  };
  gradagg::Options o;
  o.workers = 0;
  expectField(o, "workers");
  o.workers = gradagg::Options::kMaxWorkers + 1;
  expectField(o, "workers");
  o = {};
  o.threads_per_worker = -1;
  expectField(o, "threads_per_worker");
  o = {};
  o.step_timeout = 0ms;
  expectField(o, "step_timeout");
  EXPECT_THROW(gradagg::Aggregator(*model, nullptr, gradagg::Options{}), gradagg::InvalidArgument);
}

TEST_F(Behaviour, UnsupportedParameterDtypeIsAnInvalidArgumentNamingIt) {
  struct Half : torch::nn::Module {
    Half() { w = register_parameter("w", torch::ones({2}, torch::kHalf)); }
    torch::Tensor w;
  } m;
  auto noop = [](const gradagg::ShardContext&) { return gradagg::ShardResult{}; };
  if (const auto e = expectThrows<gradagg::InvalidArgument>(
          [&] { gradagg::Aggregator agg(m, noop); }, "'w'"))
    EXPECT_NE(std::string(e->what()).find("Half"), std::string::npos) << e->what();
}

TEST_F(Behaviour, ParameterReshapedInTheParentIsAnInvalidArgumentBeforeAnyUpdate) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kFloat);
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(8, 2, false)), opts(2));
  agg.step();
  model->named_parameters()["fc2.bias"].set_data(torch::zeros({5}));
  expectThrows<gradagg::InvalidArgument>([&] { agg.step(); }, "'fc2.bias'");
}

TEST_F(Behaviour, ParameterValueReplacedInTheParentIsTakenBackIntoTheSnapshot) {
  auto model = makeModel(ModelKind::kMlp, torch::kDouble);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kDouble);
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(8, 2, false)), opts(2));
  agg.step();
  // New storage, same shape (what loading a checkpoint may do).
  model->named_parameters()["fc1.weight"].set_data(torch::full({16, 6}, 0.1, torch::kDouble));
  const auto want = fullBatchGrads(*model, data);
  agg.step();
  expectClose(gradsOf(*model), want, 1e-12, "after the parent replaced fc1.weight");
}

TEST_F(Behaviour, ModelGetsItsOwnMemoryBackWhenTheAggregatorIsDestroyed) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kFloat);
  std::vector<torch::Tensor> params, grads;
  {
    gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(8, 2, false)), opts(2));
    agg.step();
    params = model->parameters();
    for (auto& p : params) p = p.detach().clone();
    grads = gradsOf(*model);
  }
  // The segment is unmapped: reading (and training) must still work.
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_TRUE(torch::equal(model->parameters()[k], params[k]));
    EXPECT_TRUE(torch::equal(model->parameters()[k].grad(), grads[k]));
  }
  torch::optim::SGD sgd(model->parameters(), 0.1);
  sgd.zero_grad();
  model->loss(model->forward(data.x), data.y).backward();
  sgd.step();
}

TEST_F(Behaviour, TwoAggregatorsInOneProcessDoNotCollide) {
  auto m1 = makeModel(ModelKind::kMlp, torch::kDouble, 1);
  auto m2 = makeModel(ModelKind::kMlp, torch::kDouble, 2);
  const Data data = makeData(ModelKind::kMlp, 12, torch::kDouble);
  const auto want1 = fullBatchGrads(*m1, data), want2 = fullBatchGrads(*m2, data);
  gradagg::Aggregator a1(*m1, shardFn(*m1, data, shardBounds(12, 2, false)), opts(2));
  gradagg::Aggregator a2(*m2, shardFn(*m2, data, shardBounds(12, 3, false)), opts(3));
  a1.step();
  a2.step();
  expectClose(gradsOf(*m1), want1, 1e-12, "first");
  expectClose(gradsOf(*m2), want2, 1e-12, "second");
}

TEST_F(Behaviour, ShutdownIsIdempotentAndStepAfterItIsNotUsable) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(4, 2, false)), opts(2));
  agg.step();
  agg.shutdown();
  agg.shutdown();
  EXPECT_TRUE(childPids().empty());
  EXPECT_FALSE(agg.usable());
  EXPECT_THROW(agg.step(), gradagg::NotUsable);
}

TEST_F(Behaviour, MovedAggregatorKeepsWorking) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator a(*model, shardFn(*model, data, shardBounds(4, 2, false)), opts(2));
  gradagg::Aggregator b(std::move(a));
  EXPECT_NO_THROW(b.step());
  EXPECT_THROW(a.step(), gradagg::NotUsable);  // NOLINT(bugprone-use-after-move)
}

}  // namespace
}  // namespace gradagg_test
