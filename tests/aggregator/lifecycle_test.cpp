// An aggregator's life: two side by side, shutdown, a move, the model that
// gets its own memory back when the aggregator goes, a thread that made it and
// ended, a process forked from its owner.
#include "behaviour.h"

#include <sys/wait.h>
#include <unistd.h>

#include <optional>
#include <thread>

namespace gradagg_test {
namespace {

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
  // What is left of `a` still answers its accessors.
  EXPECT_FALSE(a.usable());
  EXPECT_EQ(a.workers(), 0);
  EXPECT_EQ(a.options().workers, gradagg::Options().workers);
  EXPECT_EQ(b.options().workers, 2);
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

// PR_SET_PDEATHSIG fires when the forking *thread* ends: the workers must not.
TEST_F(Behaviour, WorkersOutliveTheThreadThatMadeTheAggregator) {
  auto model = makeModel(ModelKind::kMlp, torch::kDouble);
  const Data data = makeData(ModelKind::kMlp, 12, torch::kDouble);
  const auto want = fullBatchGrads(*model, data);
  std::optional<gradagg::Aggregator> agg;
  std::thread([&] {
    agg.emplace(*model, shardFn(*model, data, shardBounds(12, 3, false)), opts(3));
  }).join();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a signal has time to land
  ASSERT_TRUE(agg->usable());
  agg->step();
  expectClose(gradsOf(*model), want, 1e-12, "after the thread ended");
  EXPECT_EQ(childPids().size(), 3u);
}

// A process forked from the owner (the user's fork(), Python's os.fork()) holds
// a copy of the Aggregator: it can neither step nor stop the owner's workers,
// and its end (destructors included) leaves them alone.
TEST_F(Behaviour, AProcessForkedFromTheOwnerNeverTouchesItsWorkers) {
  auto model = makeModel(ModelKind::kMlp, torch::kDouble);
  const Data data = makeData(ModelKind::kMlp, 12, torch::kDouble);
  const auto want = fullBatchGrads(*model, data);
  auto agg = std::make_unique<gradagg::Aggregator>(
      *model, shardFn(*model, data, shardBounds(12, 2, false)), opts(2));
  const pid_t child = ::fork();
  if (child == 0) {
    int code = 0;
    if (agg->usable()) code |= 1;
    try {
      agg->step();
      code |= 2;
    } catch (const gradagg::NotUsable& e) {
      if (std::string(e.what()).find("copy made by fork()") == std::string::npos) code |= 4;
    } catch (...) {
      code |= 8;
    }
    agg->shutdown();
    agg.reset();  // the destructor, as at a normal exit
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: usable, 2: stepped, 4: unclear error, 8: other error";
  ASSERT_TRUE(agg->usable());
  agg->step();
  expectClose(gradsOf(*model), want, 1e-12, "after the forked copy ended");
}

}  // namespace
}  // namespace gradagg_test
