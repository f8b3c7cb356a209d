// Fits y = 2x with two workers through the installed package; exits 0 when the
// gradient equals the one computed here in one process.
#include <cmath>
#include <cstdio>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <gradagg/gradagg.h>

struct Scale : torch::nn::Module {
  Scale() { w = register_parameter("w", at::ones({1})); }
  at::Tensor w;
};

int main() {
  Scale m;
  const auto x = at::arange(1, 5, at::kFloat), y = 2 * x;
  gradagg::Options options;
  options.workers = 2;
  gradagg::Aggregator agg(
      m,
      [&](const gradagg::ShardContext& c) {
        auto xs = x.slice(0, 2 * c.rank, 2 * c.rank + 2),
             ys = y.slice(0, 2 * c.rank, 2 * c.rank + 2);
        return gradagg::ShardResult{(m.w * xs - ys).pow(2).mean(), 2};
      },
      options);
  agg.step();
  const double got = m.w.grad().item<double>();
  const double want =
      (2 * (1 - 2) * x * x).mean().item<double>();  // d/dw mean((w x - 2x)^2) at w=1
  std::printf("consumer: gradient %.9f, expected %.9f\n", got, want);
  return std::abs(got - want) <= 1e-6 * std::abs(want) ? 0 : 1;
}
