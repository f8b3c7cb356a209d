// What "exact" means, runnable (docs/how-it-works.md, "What exact means"): a
// float64 MLP with dropout trained by gradagg workers over sharded batches,
// and the same training in this one process, built from the public rule:
//   - the same global batch of each step, split the same way
//     (ShardedBatches::batch for each global rank);
//   - worker r's generator seeded with gradagg::workerSeed(seed, r, step)
//     before its part, so every dropout mask is the one worker r drew;
//   - the parts' gradients weighted by their samples and summed in rank order.
// The two agree to float64 rounding (exit 0), or the program says by how much
// (exit 1). With --whole-batch the reference computes each step on the whole
// global batch at once instead (no dropout then): the same mathematics summed
// in another order, which differs in the last bits, as a different thread
// count does in one process.
#include <algorithm>
#include <cstdint>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <gradagg/data.h>
#include <gradagg/gradagg.h>

#include "exit_status.h"

namespace {

struct NetImpl : torch::nn::Module {
  explicit NetImpl(double dropout) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 1));
    drop = register_module("drop", torch::nn::Dropout(dropout));
    to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2->forward(drop->forward(torch::relu(fc1->forward(x))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Net);

using Dataset = torch::data::datasets::TensorDataset;
using Batches = gradagg::data::ShardedBatches<Dataset>;

torch::Tensor lossOf(Net& net, const torch::Tensor& rows) {
  auto x = rows.narrow(1, 0, 8), y = rows.narrow(1, 8, 1);
  return torch::mse_loss(net->forward(x), y);
}

// One step of the one-process reference at `position`: each worker's part
// with worker r's seed, weighted by samples, then the optimizer's step.
void referenceStep(Net& net, torch::optim::SGD& opt, Batches& data, std::uint64_t seed,
                   std::int64_t step, const gradagg::BatchPosition& position, int workers,
                   bool whole_batch) {
  opt.zero_grad();
  if (whole_batch) {
    lossOf(net, data.global_batch(position).data).backward();
    opt.step();
    return;
  }
  std::vector<torch::Tensor> sum;
  std::int64_t total = 0;
  for (int r = 0; r < workers; ++r) {
    gradagg::ShardContext ctx;
    ctx.step = step;
    ctx.position = position;
    ctx.global_rank = r;
    ctx.global_workers = workers;
    auto rows = data.batch(ctx).data;
    if (rows.size(0) == 0) continue;
    torch::manual_seed(gradagg::workerSeed(seed, r, step));
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    lossOf(net, rows).backward();
    const auto params = net->parameters();
    for (std::size_t k = 0; k < params.size(); ++k) {
      auto weighted = params[k].grad() * static_cast<double>(rows.size(0));
      if (sum.size() <= k)
        sum.push_back(weighted);
      else
        sum[k] += weighted;
    }
    total += rows.size(0);
  }
  const auto params = net->parameters();
  for (std::size_t k = 0; k < params.size(); ++k)
    params[k].mutable_grad() = sum[k] / static_cast<double>(total);
  opt.step();
}

int run(int argc, char** argv) {
  int workers = 4, epochs = 2;
  std::uint64_t seed = 1;
  bool whole_batch = false;
  CLI::App app{"gradagg's exactness with dropout: workers against the one-process reference"};
  app.add_option("-w,--workers", workers, "worker processes")->check(CLI::Range(1, 8));
  app.add_option("--epochs", epochs, "epochs of 100 samples in batches of 32")
      ->check(CLI::Range(1, 100));
  app.add_option("--seed", seed, "torch::manual_seed of the run (the workers' seeds follow it)");
  app.add_flag("--whole-batch", whole_batch,
               "the reference computes each step on the whole batch, without dropout");
  if (const auto done = example::parseCommandLine(app, argc, argv)) return *done;
  const double dropout = whole_batch ? 0.0 : 0.3;

  torch::manual_seed(7);
  auto rows = torch::randn({100, 9}, torch::kDouble);
  Batches data(Dataset(rows), 32, {/*shuffle=*/true, /*seed=*/3});

  torch::manual_seed(7);
  Net net(dropout);
  torch::manual_seed(7);
  Net reference(dropout);    // the same initial values
  torch::manual_seed(seed);  // the program's --seed: gradagg's workers derive theirs from it
  torch::optim::SGD opt(net->parameters(), 0.05), ref_opt(reference->parameters(), 0.05);
  gradagg::Options options;
  options.workers = workers;
  gradagg::Aggregator agg(
      *net,
      [&](const gradagg::ShardContext& ctx) {
        auto batch = data.batch(ctx).data;
        if (batch.size(0) == 0) return gradagg::ShardResult{{}, 0};
        return gradagg::ShardResult{lossOf(net, batch), batch.size(0)};
      },
      options);

  std::int64_t step = 0;
  for (std::int64_t epoch = 0; epoch < epochs; ++epoch) {
    for (const gradagg::BatchPosition& position : data.steps(epoch)) {
      opt.zero_grad();
      agg.step(position);
      opt.step();
      referenceStep(reference, ref_opt, data, *agg.options().seed, step++, position, workers,
                    whole_batch);
    }
  }

  double worst = 0;
  const auto mine = net->parameters(), theirs = reference->parameters();
  for (std::size_t k = 0; k < mine.size(); ++k)
    worst = std::max(worst, ((mine[k] - theirs[k]).norm() / theirs[k].norm()).item<double>());
  const bool same = torch::equal(mine[0], theirs[0]) && torch::equal(mine[1], theirs[1]) &&
                    torch::equal(mine[2], theirs[2]) && torch::equal(mine[3], theirs[3]);
  fmt::print("{} workers, {} steps{}: largest relative difference of a parameter {:.3g}{}\n",
             workers, step, whole_batch ? " (the reference on the whole batch)" : ", dropout 0.3",
             worst, same ? " (bit for bit)" : "");
  return worst <= 1e-12 ? example::kDone : example::kResultsDiffer;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    return example::fail("dropout_reference", e);
  }
}
