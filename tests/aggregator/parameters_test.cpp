// Which gradient each parameter gets: unused, used by some workers only, frozen,
// sparse, non-contiguous, given new storage by the parent; and equal weighting.
#include "behaviour.h"

namespace gradagg_test {
namespace {

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

TEST_F(Behaviour, UnusedParameterKeepsGradUndefinedLikeAutograd) {
  TwoParam m;
  const auto x = torch::randn({8, 3}), y = torch::randn({8});
  gradagg::Aggregator agg(
      m,
      [&](const gradagg::ShardContext& c) {
        auto xs = x.slice(0, 4 * c.rank, 4 * c.rank + 4),
             ys = y.slice(0, 4 * c.rank, 4 * c.rank + 4);
        return gradagg::ShardResult{m.loss(xs, ys, true), 4};
      },
      opts(2));
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

  gradagg::Aggregator agg(
      m,
      [&](const gradagg::ShardContext& c) {
        return gradagg::ShardResult{shard(m, c.rank), bounds[c.rank + 1] - bounds[c.rank]};
      },
      opts(3));
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

TEST_F(GradaggTest, SparseGradientsMatchSingleProcessAutograd) {
  struct Emb : torch::nn::Module {
    Emb() {
      emb = register_module("emb",
                            torch::nn::Embedding(torch::nn::EmbeddingOptions(20, 4).sparse(true)));
    }
    torch::nn::Embedding emb{nullptr};
  };
  torch::manual_seed(3);
  Emb model, ref;
  {
    torch::NoGradGuard g;
    ref.emb->weight.copy_(model.emb->weight);
  }
  const auto idx = torch::randint(0, 20, {12}, torch::kLong);
  ref.emb(idx).pow(2).mean().backward();
  gradagg::Options o;
  o.workers = 3;
  gradagg::Aggregator agg(
      model,
      [&](const gradagg::ShardContext& c) {
        return gradagg::ShardResult{
            model.emb(idx.slice(0, 4 * c.rank, 4 * c.rank + 4)).pow(2).mean(), 4};
      },
      o);
  agg.step();
  // Sparse as in one process (tests/aggregator/sparse_gradients_test.cpp has the rest).
  ASSERT_TRUE(model.emb->weight.grad().is_sparse());
  EXPECT_LE(relErr(model.emb->weight.grad().to_dense(), ref.emb->weight.grad().to_dense()), 1e-6);
}

TEST_F(GradaggTest, NonContiguousParameterIsServedContiguouslyAndMatches) {
  struct T : torch::nn::Module {
    T() { w = register_parameter("w", torch::randn({4, 3}, torch::kDouble).t()); }
    torch::Tensor w;
  } model;
  ASSERT_FALSE(model.w.is_contiguous());
  const auto x = torch::randn({6, 4}, torch::kDouble);
  auto ref_w = model.w.detach().clone().requires_grad_(true);
  x.mm(ref_w.t()).pow(2).mean().backward();
  gradagg::Options o;
  o.workers = 2;
  gradagg::Aggregator agg(
      model,
      [&](const gradagg::ShardContext& c) {
        return gradagg::ShardResult{
            x.slice(0, 3 * c.rank, 3 * c.rank + 3).mm(model.w.t()).pow(2).mean(), 3};
      },
      o);
  agg.step();
  EXPECT_LE(relErr(model.w.grad(), ref_w.grad()), 1e-12);
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

}  // namespace
}  // namespace gradagg_test
