// The parent's buffers and training mode reach the workers; BufferSync decides the
// parent's buffers after a step; the workers' intra-op threads, also after fork.
#include <map>
#include <stdexcept>
#include <string>

#include <ATen/Parallel.h>

#include "behaviour.h"

namespace gradagg_test {
namespace {

using namespace std::chrono_literals;

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
      case gradagg::BufferSync::kKeepParent:
        want = before.at(name);
        break;
      case gradagg::BufferSync::kFromRank0:
        want = per_rank[0].at(name);
        break;
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
  if (GetParam() != gradagg::BufferSync::kKeepParent) {
    EXPECT_FALSE(
        torch::equal(buffersOf(*model).at("bn.running_mean"), before.at("bn.running_mean")));
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, BufferSyncTest,
                         ::testing::Values(gradagg::BufferSync::kFromRank0,
                                           gradagg::BufferSync::kMean,
                                           gradagg::BufferSync::kKeepParent),
                         [](const auto& tested) {
                           switch (tested.param) {
                             case gradagg::BufferSync::kFromRank0:
                               return "FromRank0";
                             case gradagg::BufferSync::kMean:
                               return "Mean";
                             default:
                               return "KeepParent";
                           }
                         });

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
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        if (at::get_num_threads() != 2) throw std::runtime_error("worker does not have 2 threads");
        auto b = torch::randn({256, 256});
        for (int i = 0; i < 4; ++i) b = torch::tanh(b.mm(b) / 256);  // parallel regions
        return inner(c);
      },
      o);
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

}  // namespace
}  // namespace gradagg_test
