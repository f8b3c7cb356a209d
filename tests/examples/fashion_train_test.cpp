// The Fashion-MNIST example's training (examples/fashion_train.h) on small
// synthetic IDX files: gradagg with W workers of batch b equals an independent
// single-process loop with batch W*b over the same samples, and a run stopped and
// resumed from its checkpoint equals one that was never interrupted.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fashion_model.h"
#include "fashion_train.h"
#include "idx.h"

#include "fashion_support.h"
#include "runtime/temp_dir.h"
#include "support/expect_throws.h"

namespace {

using fashion::OptimizerKind;
using gradagg::detail::TempDir;
using gradagg_test::expectThrows;

constexpr int kSide = 8;  // 8x8 images: small and quick, the reader takes any size

// A synthetic data set: labels at random, images noise plus a class-dependent bar,
// so that the loss has something to learn. Written as the four gzipped IDX files.
struct SyntheticData {
  torch::Tensor train_images, train_labels;  // uint8 {n, side*side}, int64 {n}
  torch::Tensor test_images, test_labels;
};

SyntheticData writeSynthetic(const std::string& dir, std::int64_t n_train, std::int64_t n_test) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2024);
  auto make = [&](std::int64_t n) {
    auto labels = torch::randint(0, fashion::kClasses, {n}, gen, torch::kLong);
    auto images = torch::randint(0, 128, {n, kSide * kSide}, gen, torch::kLong);
    images += 120 * torch::nn::functional::one_hot(labels % kSide, kSide).repeat({1, kSide});
    return std::make_pair(images.clamp(0, 255).to(torch::kByte).contiguous(), labels);
  };
  auto write = [&](const std::string& name, const torch::Tensor& t,
                   std::vector<std::uint32_t> dims) {
    idx::IdxArray a;
    a.dims = std::move(dims);
    const auto bytes = t.to(torch::kByte).contiguous();
    a.data.assign(bytes.data_ptr<std::uint8_t>(), bytes.data_ptr<std::uint8_t>() + bytes.numel());
    idx::writeIdx(dir + "/" + name, a, true);
  };
  SyntheticData d;
  std::tie(d.train_images, d.train_labels) = make(n_train);
  std::tie(d.test_images, d.test_labels) = make(n_test);
  const auto nt = static_cast<std::uint32_t>(n_train), ns = static_cast<std::uint32_t>(n_test);
  write("train-images-idx3-ubyte.gz", d.train_images, {nt, kSide, kSide});
  write("train-labels-idx1-ubyte.gz", d.train_labels, {nt});
  write("t10k-images-idx3-ubyte.gz", d.test_images, {ns, kSide, kSide});
  write("t10k-labels-idx1-ubyte.gz", d.test_labels, {ns});
  return d;
}

// The reference: the same model trained in this process by plain autograd, batch
// `global` over each epoch's permutation in order, the last smaller batch too.
// Shares nothing with the code under test but the
// model, its initial weights and the permutation.
std::vector<torch::Tensor> referenceTraining(const SyntheticData& data, std::int64_t limit,
                                             const fashion::TrainConfig& c) {
  const auto images = data.train_images.slice(0, 0, limit);
  const auto labels = data.train_labels.slice(0, 0, limit);
  const std::int64_t n = images.size(0), global = std::int64_t{c.workers} * c.batch;
  auto model = fashion::makeNet(kSide * kSide, c.hidden, c.seed);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (c.optimizer == OptimizerKind::kAdam) {
    opt =
        std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(c.lr));
  } else {
    opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(c.lr));
  }
  for (int epoch = 0; epoch < c.epochs; ++epoch) {
    const auto order = fashion::epochOrder(n, c.seed, epoch);
    for (std::int64_t start = 0; start < n; start += global) {
      const auto rows = order.slice(0, start, std::min(n, start + global));
      const auto x = images.index_select(0, rows).to(torch::kFloat) / 255.0;
      const auto y = labels.index_select(0, rows);
      opt->zero_grad();
      torch::nn::functional::cross_entropy(model->forward(x), y).backward();
      opt->step();
    }
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

torch::Tensor asTensor(const fashion::Parameter& p) {
  return torch::tensor(p.values).reshape(p.shape);
}

double relErr(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>() /
         std::max(b.to(torch::kDouble).norm().item<double>(), 1e-30);
}

bool bitwiseEqual(const std::vector<fashion::Parameter>& a,
                  const std::vector<fashion::Parameter>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].values.size() != b[i].values.size() ||
        std::memcmp(a[i].values.data(), b[i].values.data(), a[i].values.size() * sizeof(float)) !=
            0) {
      return false;
    }
  }
  return true;
}

class FashionTrainingTest : public ::testing::Test {
 protected:
  void TearDown() override {
    EXPECT_TRUE(fashion_test::childPids().empty()) << "a test left worker processes behind";
  }
  fashion::TrainConfig config(const TempDir& dir) const {
    fashion::TrainConfig c;
    c.data_dir = dir.path();
    c.hidden = 16;
    c.seed = 5;
    c.step_timeout_s = 60;  // every multi-process step has a deadline
    return c;
  }
};

struct ParityCase {
  int workers, batch;
  OptimizerKind optimizer;
  double lr;
};

void PrintTo(const ParityCase& c, std::ostream* os) {
  *os << c.workers << " workers x batch " << c.batch << ", " << fashion::optimizerName(c.optimizer)
      << " lr " << c.lr;
}

class FashionTrainingParity : public FashionTrainingTest,
                              public ::testing::WithParamInterface<ParityCase> {};

// 250 samples: with W*b = 16 an epoch is 15 full steps and a last one of 10
// samples, 5 per worker; with 3 x 5 it is 16 steps and 10 left (4, 3, 3); with
// 4 x 31 it is 2 full steps and 2 left, so two workers have no rows (0 samples).
TEST_P(FashionTrainingParity, WorkersWithBatchBEqualOneProcessWithBatchWTimesB) {
  const ParityCase& pc = GetParam();
  TempDir dir;
  const auto data = writeSynthetic(dir.path(), 300, 50);
  auto c = config(dir);
  c.workers = pc.workers;
  c.batch = pc.batch;
  c.optimizer = pc.optimizer;
  c.lr = pc.lr;
  c.epochs = 3;
  c.limit = 250;

  const auto want = referenceTraining(data, c.limit, c);
  const auto got = fashion::train(c);
  ASSERT_EQ(got.parameters.size(), want.size());
  EXPECT_EQ(got.train_samples, 250);
  EXPECT_EQ(got.epochs.size(), 3u);
  // Tolerance: 1e-5 relative (norm of the difference over the norm) per parameter.
  // The workers sum in another order than one process (and run 1 thread each), so
  // the float32 results differ in the last bits; 50 Adam steps keep that far below.
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_LE(relErr(asTensor(got.parameters[i]), want[i]), 1e-5) << got.parameters[i].name;
  }
  // The --single mode used for the README's comparison trains the same way.
  c.single = true;
  const auto single = fashion::train(c);
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_LE(relErr(asTensor(single.parameters[i]), want[i]), 1e-5) << single.parameters[i].name;
  }
  // The training accuracy the workers count (StepReport::metrics) is the one
  // process's, up to a sample whose argmax the last bits may flip.
  for (std::size_t e = 0; e < got.epochs.size(); ++e) {
    EXPECT_GT(got.epochs[e].train_accuracy, 0) << "epoch " << e;
    EXPECT_NEAR(got.epochs[e].train_accuracy, single.epochs[e].train_accuracy, 2.5 / 250)
        << "epoch " << e;
  }
  // It learned something: the training loss fell.
  EXPECT_LT(got.epochs.back().train_loss, got.epochs.front().train_loss);
}

INSTANTIATE_TEST_SUITE_P(Cases, FashionTrainingParity,
                         ::testing::Values(ParityCase{2, 8, OptimizerKind::kAdam, 1e-2},
                                           ParityCase{2, 8, OptimizerKind::kSgd, 0.1},
                                           ParityCase{3, 5, OptimizerKind::kAdam, 1e-2},
                                           ParityCase{4, 31, OptimizerKind::kAdam, 1e-2}),
                         [](const auto& tested) {
                           return std::to_string(tested.param.workers) + "x" +
                                  std::to_string(tested.param.batch) + "_" +
                                  fashion::optimizerName(tested.param.optimizer);
                         });

class FashionTrainingResume : public FashionTrainingTest,
                              public ::testing::WithParamInterface<bool> {};

// Stopped in the middle of the second epoch, resumed from the checkpoint: the same
// bits as a run that was never stopped (the steps are deterministic), and the same
// metrics for the epochs after the stop.
TEST_P(FashionTrainingResume, ResumedRunEqualsUninterruptedRun) {
  TempDir dir;
  writeSynthetic(dir.path(), 200, 50);
  auto c = config(dir);
  c.single = GetParam();
  c.workers = 2;
  c.batch = 8;  // 200 / 16: 12 full steps and 8 left, 13 steps per epoch
  c.lr = 1e-2;
  c.epochs = 3;

  const auto whole = fashion::train(c);
  ASSERT_FALSE(whole.stopped);
  ASSERT_EQ(whole.steps, 39);

  c.checkpoint = dir.file("run.pt");
  c.stop_after = 19;  // 6 steps into the second epoch
  const auto first = fashion::train(c);
  EXPECT_TRUE(first.stopped);
  EXPECT_EQ(first.steps, 19);
  ASSERT_EQ(first.epochs.size(), 1u);
  EXPECT_FALSE(bitwiseEqual(first.parameters, whole.parameters));

  c.stop_after = 0;
  c.resume = c.checkpoint;
  const auto second = fashion::train(c);
  EXPECT_FALSE(second.stopped);
  EXPECT_EQ(second.steps, 39);
  EXPECT_TRUE(bitwiseEqual(second.parameters, whole.parameters))
      << "resumed parameters differ from the uninterrupted run's";
  ASSERT_EQ(second.epochs.size(), 2u);
  for (int e = 1; e < 3; ++e) {
    const auto& got = second.epochs[static_cast<std::size_t>(e - 1)];
    const auto& want = whole.epochs[static_cast<std::size_t>(e)];
    EXPECT_EQ(got.epoch, want.epoch);
    EXPECT_EQ(got.samples, want.samples);
    EXPECT_EQ(got.train_loss, want.train_loss) << "epoch " << e;
    EXPECT_EQ(got.test_loss, want.test_loss) << "epoch " << e;
    EXPECT_EQ(got.test_accuracy, want.test_accuracy) << "epoch " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(GradaggAndSingle, FashionTrainingResume, ::testing::Bool(),
                         [](const auto& tested) { return tested.param ? "Single" : "TwoWorkers"; });

TEST_F(FashionTrainingTest, ResumeRefusesOtherSettings) {
  TempDir dir;
  writeSynthetic(dir.path(), 100, 20);
  auto c = config(dir);
  c.epochs = 1;
  c.batch = 10;
  c.checkpoint = dir.file("run.pt");
  fashion::train(c);
  c.resume = c.checkpoint;
  c.batch = 20;  // the checkpoint was written with batch 10
  expectThrows<std::runtime_error>([&] { fashion::train(c); }, "batch");
  c.resume = dir.file("absent.pt");
  EXPECT_THROW(fashion::train(c), std::runtime_error);
}

TEST_F(FashionTrainingTest, LearnsTheRealDataWhenInstalled) {
  fashion::TrainConfig c;
  if (!std::filesystem::exists(c.data_dir + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << c.data_dir << " is absent (Debian package " << idx::kDebianFashionMnistPackage
                 << ")";
  }
  c.workers = 2;
  c.epochs = 1;
  c.limit = 4000;
  c.step_timeout_s = 60;
  const auto result = fashion::train(c);
  ASSERT_EQ(result.epochs.size(), 1u);
  EXPECT_EQ(result.test_samples, 10000);
  // 125 Adam steps of 32 samples: well above chance (0.1); 5 full epochs reach ~0.85.
  EXPECT_GT(result.epochs[0].test_accuracy, 0.6);
}

}  // namespace
