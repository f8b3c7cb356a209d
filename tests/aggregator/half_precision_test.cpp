// bfloat16 and float16 parameters: slots in the parameter's dtype, the sum over
// slots in float, the result rounded once. Compared with float64 autograd on
// the same (rounded) weights: gradagg's error is that of one process computing
// in the same dtype, within the dtype's tolerance.
#include "runtime/temp_dir.h"
#include "support/expect_throws.h"
#include "support/support.h"

namespace gradagg_test {
namespace {

// Tolerances on ||got - exact|| / ||exact||, with exact = float64 autograd of
// the full batch from the same weights: a few units of the dtype's epsilon
// (bf16 2^-8, fp16 2^-11) for a handful of roundings along forward and backward.
double tolerance(torch::Dtype t) { return t == torch::kBFloat16 ? 3e-2 : 4e-3; }

// y = softsign(x W1^T + b1) . w2 + b2, in `dtype`, with a float32 scale in between
// when `mixed` (an fp32 layer in a half-precision model). Elementwise ops and
// sums only: LibTorch 1.13 has no float16 matmul (nor tanh) on the CPU.
struct Small : torch::nn::Module {
  Small(torch::Dtype dtype, bool mixed) {
    torch::manual_seed(5);
    w1 = register_parameter("w1", (torch::randn({4, 3}) * 0.5).to(dtype));
    b1 = register_parameter("b1", (torch::randn({4}) * 0.1).to(dtype));
    w2 = register_parameter("w2", (torch::randn({4}) * 0.5).to(dtype));
    b2 = register_parameter("b2", torch::zeros({1}).to(dtype));
    if (mixed) scale = register_parameter("scale", torch::ones({4}));  // float32
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto z = (x.unsqueeze(1) * w1.unsqueeze(0)).sum(2) + b1;
    auto h = z / (z.abs() + 1);
    if (scale.defined()) h = (h.to(torch::kFloat) * scale).to(w1.scalar_type());
    return (h * w2).sum(1) + b2;
  }
  torch::Tensor w1, b1, w2, b2, scale;
};

torch::Tensor lossOf(Small& m, const torch::Tensor& x, const torch::Tensor& y) {
  return (m.forward(x) - y).pow(2).mean();
}

// Float64 autograd of the full batch on a float64 copy of `m`'s weights.
std::vector<torch::Tensor> exactGrads(Small& m, const torch::Tensor& x, const torch::Tensor& y) {
  Small ref(torch::kDouble, m.scale.defined());
  {
    torch::NoGradGuard no_grad;
    auto dst = ref.parameters(), src = m.parameters();
    for (size_t k = 0; k < dst.size(); ++k) dst[k].copy_(src[k]);
  }
  lossOf(ref, x.to(torch::kDouble), y.to(torch::kDouble)).backward();
  return gradsOf(ref);
}

struct HalfCase {
  torch::Dtype dtype;
  bool mixed;
};

class HalfPrecision : public GradaggTest, public ::testing::WithParamInterface<HalfCase> {};

TEST_P(HalfPrecision, GradientWithinTheDtypesToleranceOfExact) {
  const auto [dtype, mixed] = GetParam();
  Small model(dtype, mixed);
  torch::manual_seed(9);
  const auto x = torch::randn({24, 3}).to(dtype);
  const auto y = torch::randn({24}).to(dtype);
  const auto exact = exactGrads(model, x, y);
  // One process in the same dtype: how far the dtype alone takes it.
  Small single(dtype, mixed);
  lossOf(single, x, y).backward();
  const auto one_process = gradsOf(single);

  gradagg::Options options;
  options.workers = 3;
  const std::vector<int64_t> b = shardBounds(24, 3, /*unequal=*/true);
  gradagg::Aggregator agg(
      model,
      [&](const gradagg::ShardContext& ctx) {
        const auto rows = torch::indexing::Slice(b[ctx.rank], b[ctx.rank + 1]);
        return gradagg::ShardResult{lossOf(model, x.index({rows}), y.index({rows})),
                                    b[ctx.rank + 1] - b[ctx.rank]};
      },
      options);
  agg.step();
  const auto got = gradsOf(model);
  ASSERT_EQ(got.size(), exact.size());
  for (size_t k = 0; k < got.size(); ++k) {
    ASSERT_TRUE(got[k].defined());
    EXPECT_EQ(got[k].scalar_type(), model.parameters()[k].scalar_type());
    const double err = relErr(got[k], exact[k]);
    const double single_err = relErr(one_process[k], exact[k]);
    EXPECT_LE(err, tolerance(dtype)) << "parameter " << k << " (one process: " << single_err << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, HalfPrecision,
    ::testing::Values(HalfCase{torch::kBFloat16, false}, HalfCase{torch::kHalf, false},
                      HalfCase{torch::kBFloat16, true}, HalfCase{torch::kHalf, true}),
    [](const auto& tested) {
      return std::string(tested.param.dtype == torch::kBFloat16 ? "BFloat16" : "Float16") +
             (tested.param.mixed ? "WithFloat32Layer" : "");
    });

TEST_F(GradaggTest, BFloat16MlpTrainsLikeOneProcess) {
  auto model = makeModel(ModelKind::kMlp, torch::kBFloat16);
  auto single = copyModel(*model);
  const Data data = makeData(ModelKind::kMlp, 32, torch::kBFloat16);
  torch::optim::SGD opt(model->parameters(), 0.05);
  torch::optim::SGD single_opt(single->parameters(), 0.05);
  gradagg::Options options;
  options.workers = 2;
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(32, 2, false)), options);
  for (int s = 0; s < 5; ++s) {
    stepOneProcess(*single, single_opt, data);
    agg.step();
    opt.step();
  }
  // Five SGD steps in bf16 from the same start: the two runs round differently
  // (sum of shards against one batch) but stay within a few bf16 epsilons.
  expectClose(paramsOf(*model), paramsOf(*single), 2e-2, "after 5 steps");
}

TEST_F(GradaggTest, NonFiniteBFloat16GradientIsFound) {
  auto model = makeModel(ModelKind::kMlp, torch::kBFloat16);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kBFloat16);
  gradagg::Options options;
  options.workers = 2;
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& ctx) {
        auto loss = model->loss(model->forward(data.x), data.y);
        if (ctx.rank == 1) loss = loss * std::numeric_limits<float>::infinity();
        return gradagg::ShardResult{loss, 4};
      },
      options);
  EXPECT_THROW(agg.step(), gradagg::NonFiniteGradient);
}

TEST_F(GradaggTest, BFloat16AcrossNodesIsRefusedBeforeTheRendezvous) {
  auto model = makeModel(ModelKind::kMlp, torch::kBFloat16);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kBFloat16);
  gradagg::detail::TempDir dir("half-nodes");
  gradagg::Options options;
  options.nodes.nodes = 2;  // no node 1 will come: the check must not wait for it
  options.nodes.store_path = dir.path() + "/store";
  const auto begin = std::chrono::steady_clock::now();
  expectThrows<gradagg::InvalidArgument>(
      [&] {
        gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(8, 2, false)), options);
      },
      "'fc1.weight' is BFloat16");
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(5));
}

}  // namespace
}  // namespace gradagg_test
