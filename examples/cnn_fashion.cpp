// A small CNN on Fashion-MNIST (Conv2d, BatchNorm2d, Dropout) trained by gradagg
// workers through gradagg::data::ShardedBatches, or in one process (--single) on
// the same global batches, for comparison:
//
//   build/examples/cnn_fashion --workers 2 --epochs 1 --limit 12000 --threads 1
//   build/examples/cnn_fashion --single --workers 2 --epochs 1 --limit 12000 --threads 1
//
// Each worker's BatchNorm normalises its own part of the global batch and its
// running statistics are averaged over the workers (Options::buffers kMean),
// like DDP without SyncBatchNorm: unlike the MLP example, the two modes train
// the same samples in the same order but are not equal to rounding. Dropout
// masks come from the workers' generators, seeded from the global step.
#include <chrono>
#include <cstdio>
#include <optional>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <gradagg/data.h>
#include <gradagg/gradagg.h>

#include "exit_status.h"
#include "fashion_data.h"
#include "idx.h"
#include "idx_tensor.h"

namespace {

struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : conv1(register_module("conv1",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(16))),
        conv2(register_module("conv2",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(32))),
        drop(register_module("drop", torch::nn::Dropout(0.25))),
        fc(register_module("fc", torch::nn::Linear(32 * 7 * 7, 10))) {}

  // x: uint8 image rows {b, 784} -> logits {b, 10}.
  torch::Tensor forward(const torch::Tensor& rows) {
    auto x = rows.to(torch::kFloat).div_(255.0).view({-1, 1, 28, 28});
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    x = torch::max_pool2d(torch::relu(bn2(conv2(x))), 2);
    return fc(drop(x.flatten(1)));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Dropout drop;
  torch::nn::Linear fc;
};
TORCH_MODULE(Cnn);

struct Config {
  std::string data_dir = idx::kDebianFashionMnistDir;
  int workers = 2;  // with --single: only sizes the global batch
  int epochs = 1;
  int batch = 32;  // per worker
  double lr = 1e-3;
  std::uint64_t seed = 1;
  std::int64_t limit = 0;
  bool single = false;
  bool prefetch = false;
  int threads = 1;
};

double accuracy(Cnn& model, const torch::Tensor& images, const torch::Tensor& labels) {
  torch::NoGradGuard no_grad;
  model->eval();
  std::int64_t correct = 0;
  for (std::int64_t at = 0; at < images.size(0); at += 1000) {
    const auto n = std::min<std::int64_t>(1000, images.size(0) - at);
    correct += model->forward(images.narrow(0, at, n))
                   .argmax(1)
                   .eq(labels.narrow(0, at, n))
                   .sum()
                   .item<std::int64_t>();
  }
  model->train();
  return static_cast<double>(correct) / static_cast<double>(images.size(0));
}

int run(int argc, char** argv) {
  Config c;
  CLI::App app{"A CNN on Fashion-MNIST with gradagg workers, or one process (--single)"};
  app.add_option("--data", c.data_dir, "directory of the four IDX files")->capture_default_str();
  app.add_option("--workers", c.workers, "gradagg workers")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--epochs", c.epochs, "epochs")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch", c.batch, "samples per worker per step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", c.lr, "Adam's learning rate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seed", c.seed, "initial weights and data order")->capture_default_str();
  app.add_option("--limit", c.limit, "use the first N training samples (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--single", c.single, "train in this process with batch workers * batch");
  app.add_flag("--prefetch", c.prefetch, "load a worker's next batch on a loader thread");
  app.add_option("--threads", c.threads, "intra-op threads per worker (or of the one process)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  if (const auto done = example::parseCommandLine(app, argc, argv)) return *done;

  const idx::MnistDir data = idx::readMnistDir(c.data_dir);
  auto train_images = idx::toTensor(data.train.images).reshape({-1, 784});
  auto train_labels = idx::labelsAsLong(data.train.labels);
  if (c.limit > 0 && c.limit < train_images.size(0)) {
    train_images = train_images.narrow(0, 0, c.limit).clone();
    train_labels = train_labels.narrow(0, 0, c.limit).clone();
  }
  const auto test_images = idx::toTensor(data.test.images).reshape({-1, 784});
  const auto test_labels = idx::labelsAsLong(data.test.labels);

  gradagg::data::ShardedBatchesOptions data_options;
  data_options.shuffle = true;
  data_options.seed = c.seed;
  data_options.prefetch = c.prefetch;
  gradagg::data::ShardedBatches batches(fashion::FashionDataset(train_images, train_labels),
                                        static_cast<std::size_t>(c.workers) * c.batch,
                                        data_options);
  torch::manual_seed(c.seed);
  Cnn model;
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(c.lr));

  std::optional<gradagg::Aggregator> agg;
  if (c.single) {
    torch::set_num_threads(c.threads);
  } else {
    gradagg::Options options;
    options.workers = c.workers;
    options.threads_per_worker = c.threads;
    options.seed = c.seed;
    agg.emplace(
        *model,
        [&](const gradagg::ShardContext& ctx) {
          const auto part = batches.batch(ctx);
          if (part.data.size(0) == 0) return gradagg::ShardResult{torch::Tensor(), 0};
          const auto logits = model->forward(part.data);
          const double correct = logits.argmax(1).eq(part.target).sum().item<double>();
          return gradagg::ShardResult{torch::nn::functional::cross_entropy(logits, part.target),
                                      part.data.size(0),
                                      {{"correct", correct}}};
        },
        options);
  }
  std::printf("%s, global batch %d, %lld training images, %lld steps per epoch\n",
              c.single ? "one process" : fmt::format("gradagg, {} workers", c.workers).c_str(),
              c.workers * c.batch, static_cast<long long>(train_images.size(0)),
              static_cast<long long>(batches.steps_per_epoch()));
  std::fflush(stdout);
  std::int64_t step = 0;
  for (int epoch = 0; epoch < c.epochs; ++epoch) {
    double loss_sum = 0, correct = 0;
    std::int64_t samples = 0;
    const auto begin = std::chrono::steady_clock::now();
    for (std::int64_t s = 0; s < batches.steps_per_epoch(); ++s, ++step) {
      adam.zero_grad();
      if (agg) {
        const gradagg::StepReport& report = agg->step();
        loss_sum += report.loss * static_cast<double>(report.samples);
        correct += report.metrics.at("correct");
        samples += report.samples;
      } else {
        const auto global = batches.global_batch(step);
        const auto logits = model->forward(global.data);
        auto loss = torch::nn::functional::cross_entropy(logits, global.target);
        loss.backward();
        loss_sum += loss.item<double>() * static_cast<double>(global.data.size(0));
        correct += logits.argmax(1).eq(global.target).sum().item<double>();
        samples += global.data.size(0);
      }
      adam.step();
      if (const int signal = example::stopSignal()) return 128 + signal;
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    std::printf(
        "epoch %d  train loss %.4f  train accuracy %.4f  test accuracy %.4f  %.0f samples/s\n",
        epoch + 1, loss_sum / static_cast<double>(samples), correct / static_cast<double>(samples),
        accuracy(model, test_images, test_labels), static_cast<double>(samples) / seconds);
    std::fflush(stdout);
  }
  return example::kDone;
}

}  // namespace

int main(int argc, char** argv) {
  example::stopSignals();
  example::runMain("cnn_fashion", run, argc, argv);
}
