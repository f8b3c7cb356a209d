// Sparse gradients (Embedding(sparse=true)): the parent's .grad is sparse and
// coalesced, equal to one process's after coalesce(), touched rows whose
// gradient is exactly zero included; SGD over them trains as one process does.
#include "support/support.h"

namespace {

using namespace gradagg_test;

class SparseGradients : public GradaggTest {};

// An embedding bag: the mean of a sample's rows through ReLU and a linear head.
// Row 3 starts all negative, so the ReLU stops its gradient: a touched row
// whose gradient is exactly zero.
struct Bag : torch::nn::Module {
  Bag() {
    torch::manual_seed(5);
    emb = register_module("emb",
                          torch::nn::Embedding(torch::nn::EmbeddingOptions(12, 4).sparse(true)));
    head = register_module("head", torch::nn::Linear(4, 1));
    torch::NoGradGuard no_grad;
    emb->weight[3].fill_(-1.0);
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& y) {
    auto h = torch::relu(emb->forward(ids)).mean(1);
    return torch::mse_loss(head->forward(h).squeeze(1), y);
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
};

struct Batch {
  torch::Tensor ids, y;
};

// 9 samples of 3 ids each; rows 10 and 11 are never looked up.
Batch batch(int step) {
  torch::manual_seed(100 + step);
  return {torch::randint(0, 10, {9, 3}, torch::kLong), torch::randn({9})};
}

TEST_F(SparseGradients, TheGradIsSparseCoalescedAndOneProcesssAfterCoalesce) {
  Bag one;
  const Batch b = batch(0);
  one.loss(b.ids, b.y).backward();
  const torch::Tensor want = one.emb->weight.grad().coalesce();
  ASSERT_TRUE(want.is_sparse());

  Bag model;
  gradagg::Options o;
  o.workers = 3;
  gradagg::Aggregator agg(
      model,
      [&](const gradagg::ShardContext& ctx) {
        const auto rows = b.ids.narrow(0, 3 * ctx.rank, 3);
        return gradagg::ShardResult{model.loss(rows, b.y.narrow(0, 3 * ctx.rank, 3)), 3};
      },
      o);
  agg.step();
  const torch::Tensor got = model.emb->weight.grad();
  ASSERT_TRUE(got.is_sparse());
  EXPECT_TRUE(got.is_coalesced());
  EXPECT_EQ(got.sparse_dim(), want.sparse_dim());
  EXPECT_EQ(got.dense_dim(), want.dense_dim());
  EXPECT_TRUE(torch::equal(got.indices(), want.indices()))
      << got.indices() << " vs " << want.indices();
  EXPECT_LT(relErr(got.values(), want.values()), 1e-6);
  // Row 3, looked up, has a zero gradient and is listed all the same.
  const auto listed = got.indices()[0];
  const bool has_row3 = (listed == 3).any().item<bool>();
  EXPECT_EQ(has_row3, (b.ids == 3).any().item<bool>());
  // The dense head stays dense.
  EXPECT_FALSE(model.head->weight.grad().is_sparse());
  EXPECT_LT(relErr(model.head->weight.grad(), one.head->weight.grad()), 1e-6);
}

TEST_F(SparseGradients, SgdOverSparseGradientsTrainsAsOneProcess) {
  Bag one, model;
  torch::optim::SGD opt_one(one.parameters(), 0.5);
  torch::optim::SGD opt(model.parameters(), 0.5);
  gradagg::Options o;
  o.workers = 2;
  o.accumulation_steps = 2;  // a worker's two micro-batches touch different rows
  gradagg::Aggregator agg(
      model,
      [&](const gradagg::ShardContext& ctx) {
        // 9 rows: worker 0 takes 5 (3 + 2), worker 1 takes 4 (2 + 2).
        const int64_t begin[2][2] = {{0, 3}, {5, 7}}, size[2][2] = {{3, 2}, {2, 2}};
        const int64_t at = begin[ctx.rank][ctx.micro_step], n = size[ctx.rank][ctx.micro_step];
        // The step's batch comes from the parent with the message.
        const auto& ids = ctx.message.at("ids");
        const auto& y = ctx.message.at("y");
        return gradagg::ShardResult{model.loss(ids.narrow(0, at, n), y.narrow(0, at, n)), n};
      },
      o);
  for (int step = 0; step < 6; ++step) {
    const Batch current = batch(step);
    opt_one.zero_grad();
    one.loss(current.ids, current.y).backward();
    opt_one.step();
    opt.zero_grad();
    agg.step(gradagg::Message{{"ids", current.ids}, {"y", current.y}});
    ASSERT_TRUE(model.emb->weight.grad().is_sparse());
    opt.step();
  }
  expectClose(paramsOf(model), paramsOf(one), 1e-5, "after 6 SGD steps");
  // Rows 10 and 11 were never looked up: untouched, bit for bit.
  EXPECT_TRUE(torch::equal(model.emb->weight.narrow(0, 10, 2), one.emb->weight.narrow(0, 10, 2)));
}

}  // namespace
