// An aggregator's life: two side by side, shutdown, a move, and the model that
// gets its own memory back when the aggregator goes.
#include "behaviour.h"

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

}  // namespace
}  // namespace gradagg_test
