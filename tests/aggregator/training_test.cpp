// Several optimizer steps match single-process training step for step, and two
// runs of the same training give bit-identical parameters.
#include "support/support.h"

namespace gradagg_test {
namespace {

enum class Opt { kSgd, kAdam };

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(Opt opt, torch::nn::Module& m) {
  if (opt == Opt::kSgd)
    return std::make_unique<torch::optim::SGD>(m.parameters(),
                                               torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(m.parameters(), torch::optim::AdamOptions(0.01));
}

struct TrainCase {
  Opt opt;
  torch::Dtype dtype;
};

class Training : public GradaggTest, public ::testing::WithParamInterface<TrainCase> {};

TEST_P(Training, MatchesSingleProcessStepForStep) {
  const auto [opt, dtype] = GetParam();
  const int steps = 6;
  auto model = makeModel(ModelKind::kMlp, dtype);
  auto single = copyModel(*model);
  const Data data = makeData(ModelKind::kMlp, 30, dtype);
  auto optimizer = makeOptimizer(opt, *model);
  auto single_opt = makeOptimizer(opt, *single);

  gradagg::Options options;
  options.workers = 3;
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(30, 3, true)), options);
  // Errors compound over steps; fp32 rounding of Adam's update: 1e-5, fp64: 1e-11.
  const double tol = dtype == torch::kFloat ? 1e-5 : 1e-11;
  for (int s = 0; s < steps; ++s) {
    stepOneProcess(*single, *single_opt, data);

    optimizer->zero_grad();
    agg.step();
    optimizer->step();
    expectClose(paramsOf(*model), paramsOf(*single), tol, "after step " + std::to_string(s));
  }
  EXPECT_EQ(agg.stepsDone(), steps);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, Training,
                         ::testing::Values(TrainCase{Opt::kSgd, torch::kFloat},
                                           TrainCase{Opt::kSgd, torch::kDouble},
                                           TrainCase{Opt::kAdam, torch::kFloat},
                                           TrainCase{Opt::kAdam, torch::kDouble}),
                         [](const auto& tested) {
                           return std::string(tested.param.opt == Opt::kSgd ? "Sgd" : "Adam") +
                                  (tested.param.dtype == torch::kFloat ? "Float32" : "Float64");
                         });

std::vector<torch::Tensor> trainOnce(int workers) {
  auto model = makeModel(ModelKind::kConvBnTrain, torch::kFloat);
  const Data data = makeData(ModelKind::kConvBnTrain, 20, torch::kFloat);
  auto optimizer = makeOptimizer(Opt::kAdam, *model);
  gradagg::Options options;
  options.workers = workers;
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(20, workers, true)), options);
  for (int s = 0; s < 5; ++s) {
    optimizer->zero_grad();
    agg.step();
    optimizer->step();
  }
  auto out = paramsOf(*model);
  for (auto& b : model->buffers()) out.push_back(b.clone());
  return out;
}

class Reproducible : public GradaggTest, public ::testing::WithParamInterface<int> {};

TEST_P(Reproducible, TwoRunsGiveBitIdenticalParametersAndBuffers) {
  const auto first = trainOnce(GetParam());
  const auto second = trainOnce(GetParam());
  ASSERT_EQ(first.size(), second.size());
  for (size_t k = 0; k < first.size(); ++k)
    EXPECT_TRUE(torch::equal(first[k], second[k])) << "tensor " << k << " differs";
}

INSTANTIATE_TEST_SUITE_P(Workers, Reproducible, ::testing::Values(2, 3, 4));

}  // namespace
}  // namespace gradagg_test
