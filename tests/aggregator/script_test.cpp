// A TorchScript module (torch::jit::Module, defined here as torch::jit::load
// would give it) trained through gradagg::viewOf(jit module): the same
// parameters as the same module trained in one process on the full batch.
#include <gradagg/script.h>

#include "support/expect_throws.h"
#include "support/support.h"

namespace gradagg_test {
namespace {

// y = w2 . tanh(W1 x + b1 + shift) + b2; `shift` is a buffer. In training mode
// the output is doubled, so a worker in the wrong mode gives another gradient.
torch::jit::Module makeScript() {
  torch::manual_seed(3);
  torch::jit::Module m("Net");
  m.register_parameter("w1", torch::randn({4, 3}).requires_grad_(), false);
  m.register_parameter("b1", torch::randn({4}).requires_grad_(), false);
  m.register_parameter("w2", torch::randn({1, 4}).requires_grad_(), false);
  m.register_parameter("b2", torch::randn({1}).requires_grad_(), false);
  m.register_buffer("shift", torch::full({4}, 0.25));
  m.register_attribute("training", c10::BoolType::get(), true);
  m.define(R"(
    def forward(self, x):
        h = torch.tanh(torch.matmul(x, self.w1.t()) + self.b1 + self.shift)
        y = torch.matmul(h, self.w2.t()) + self.b2
        if self.training:
            y = y * 2.0
        return y
  )");
  return m;
}

at::Tensor scriptLoss(torch::jit::Module& m, const at::Tensor& x, const at::Tensor& y) {
  return torch::mse_loss(m.forward({x}).toTensor(), y);
}

std::vector<at::Tensor> paramsOfScript(const torch::jit::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

class Script : public GradaggTest, public ::testing::WithParamInterface<bool> {};

TEST_P(Script, TrainsLikeOneProcess) {
  const bool training = GetParam();
  torch::jit::Module model = makeScript();
  torch::jit::Module single = [&] {
    torch::jit::Module copy;
    {
      torch::NoGradGuard no_grad;  // leaves, as the originals
      copy = model.deepcopy();
    }
    for (auto p : copy.parameters()) p.requires_grad_();
    return copy;
  }();
  model.train(training);
  single.train(training);
  torch::manual_seed(5);
  const at::Tensor x = torch::randn({12, 3});
  const at::Tensor y = torch::randn({12, 1});

  std::vector<at::Tensor> params, single_params;
  for (const auto& p : model.parameters()) params.push_back(p);
  for (const auto& p : single.parameters()) single_params.push_back(p);
  torch::optim::SGD opt(params, 0.05);
  torch::optim::SGD single_opt(single_params, 0.05);

  gradagg::Options options;
  options.workers = 3;
  const std::vector<int64_t> bounds = shardBounds(12, 3, /*unequal=*/true);
  gradagg::Aggregator agg(
      gradagg::viewOf(model),
      [&](const gradagg::ShardContext& ctx) {
        const auto rows = torch::indexing::Slice(bounds[ctx.rank], bounds[ctx.rank + 1]);
        return gradagg::ShardResult{scriptLoss(model, x.index({rows}), y.index({rows})),
                                    bounds[ctx.rank + 1] - bounds[ctx.rank]};
      },
      options);
  for (int s = 0; s < 5; ++s) {
    single_opt.zero_grad();
    scriptLoss(single, x, y).backward();
    single_opt.step();
    opt.zero_grad();
    agg.step();
    opt.step();
    expectClose(paramsOfScript(model), paramsOfScript(single), 1e-5,
                "after step " + std::to_string(s));
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, Script, ::testing::Bool(),
                         [](const auto& tested) { return tested.param ? "Train" : "Eval"; });

TEST_F(Script, AReplacedParameterIsAnError) {
  torch::jit::Module model = makeScript();
  const at::Tensor x = torch::randn({4, 3});
  gradagg::Options options;
  options.workers = 2;
  gradagg::Aggregator agg(
      gradagg::viewOf(model),
      [&](const gradagg::ShardContext&) {
        return gradagg::ShardResult{scriptLoss(model, x, torch::zeros({4, 1})), 4};
      },
      options);
  agg.step();
  model.setattr("w2", torch::randn({1, 4}).requires_grad_());
  expectThrows<gradagg::InvalidArgument>([&] { agg.step(); }, "parameter list changed");
}

}  // namespace
}  // namespace gradagg_test
