// Bad input from the caller is an InvalidArgument that names what is wrong: an
// option, a parameter's dtype, a parameter reshaped or added after construction,
// a model on a CUDA device.
#include <string>

#include "behaviour.h"
#include "support/expect_throws.h"

namespace gradagg_test {
namespace {

using namespace std::chrono_literals;

TEST_F(Behaviour, BadOptionsAreInvalidArgumentsNamingTheField) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  auto noop = [](const gradagg::ShardContext&) { return gradagg::ShardResult{}; };
  auto expectField = [&](const gradagg::Options& o, const std::string& field) {
    expectThrows<gradagg::InvalidArgument>([&] { gradagg::Aggregator agg(*model, noop, o); },
                                           field);
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
  o.step_timeout = -5ms;
  expectField(o, "step_timeout");
  o = {};
  o.nodes.timeout = -1ms;
  expectField(o, "nodes.timeout");
  EXPECT_THROW(gradagg::Aggregator(*model, nullptr, gradagg::Options{}), gradagg::InvalidArgument);
}

// A timeout too long for a deadline (1e13 ms overflowed one, and failed at
// once) is taken as 30 days: the steps run and a worker that fails is still
// reported at once.
TEST_F(Behaviour, HugeTimeoutsSaturateInsteadOfOverflowing) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kFloat);
  gradagg::Options o = opts(2);
  o.step_timeout = std::chrono::milliseconds(10'000'000'000'000);
  o.shutdown_timeout = std::chrono::milliseconds::max();
  o.nodes.timeout = std::chrono::milliseconds(10'000'000'000'000);
  auto fn = shardFn(*model, data, shardBounds(8, 2, false));
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        if (c.step == 2 && c.rank == 1) throw std::runtime_error("bad record");
        return fn(c);
      },
      o);
  EXPECT_NO_THROW(agg.step());
  EXPECT_NO_THROW(agg.step());
  expectThrows<gradagg::WorkerFailed>([&] { agg.step(); }, "bad record");
}

TEST_F(Behaviour, UnsupportedParameterDtypeIsAnInvalidArgumentNamingIt) {
  struct Complex : torch::nn::Module {
    Complex() { w = register_parameter("w", torch::ones({2}, torch::kComplexFloat)); }
    torch::Tensor w;
  } m;
  auto noop = [](const gradagg::ShardContext&) { return gradagg::ShardResult{}; };
  if (const auto e = expectThrows<gradagg::InvalidArgument>(
          [&] { gradagg::Aggregator agg(m, noop); }, "'w'")) {
    EXPECT_NE(std::string(e->what()).find("ComplexFloat"), std::string::npos) << e->what();
  }
}

TEST_F(Behaviour, ParameterReshapedInTheParentIsAnInvalidArgumentBeforeAnyUpdate) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kFloat);
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(8, 2, false)), opts(2));
  agg.step();
  model->named_parameters()["fc2.bias"].set_data(torch::zeros({5}));
  expectThrows<gradagg::InvalidArgument>([&] { agg.step(); }, "'fc2.bias'");
}

TEST_F(GradaggTest, ParameterAddedAfterConstructionIsAnInvalidArgument) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(4, 2, false)), {});
  agg.step();
  model->register_parameter("extra", torch::zeros({3}));
  expectThrows<gradagg::InvalidArgument>([&] { agg.step(); }, "parameter list changed");
  EXPECT_TRUE(agg.usable());
}

TEST_F(GradaggTest, CudaModelIsRefusedWithAClearError) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  model->to(torch::kCUDA);
  EXPECT_THROW(gradagg::Aggregator(
                   *model, [](const gradagg::ShardContext&) { return gradagg::ShardResult{}; }),
               gradagg::InvalidArgument);
}

}  // namespace
}  // namespace gradagg_test
