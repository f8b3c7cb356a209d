// Population-based training of softmax regression on Fashion-MNIST (issue #5):
// 4 workers, each with its own [784, 10] weight, [10] bias, SGD and a learning
// rate drawn log-uniformly; every --interval steps each publishes its weights
// and validation accuracy, and a policy decides whether it copies a peer.
//
//   population_softmax --policy random --p 0.15 --steps 2000 --lineage lineage.jsonl
//   population_softmax --policy truncation | tournament | none
#include <cmath>
#include <cstdio>
#include <string>

#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>
#include <CLI/CLI.hpp>

#include <gradagg/population.h>

#include "idx.h"
#include "idx_tensor.h"

namespace {

// logits = x W + b, with W [784, 10] and b [10].
struct Softmax : torch::nn::Module {
  Softmax() {
    w = register_parameter("weight", at::zeros({784, 10}));
    b = register_parameter("bias", at::zeros({10}));
  }
  at::Tensor forward(const at::Tensor& x) { return at::addmm(b, x, w); }
  at::Tensor w, b;
};

double accuracy(Softmax& m, const at::Tensor& x, const at::Tensor& y) {
  at::NoGradGuard g;
  return m.forward(x).argmax(1).eq(y).to(at::kDouble).mean().item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  std::string policy_name = "random", lineage, data = "/usr/share/datasets/fashion-mnist";
  double p = 0.15, fraction = 0.25, lr_min = 1e-4, lr_max = 1.0;
  std::int64_t steps = 2000, interval = 100, batch = 64;
  std::uint64_t seed = 1;
  int workers = 4;
  CLI::App app{"gradagg population mode: PBT of softmax regression on Fashion-MNIST"};
  app.add_option("--policy", policy_name, "random, truncation, tournament or none")
      ->check(CLI::IsMember({"random", "truncation", "tournament", "none"}));
  app.add_option("--p", p, "random: probability of copying a random peer");
  app.add_option("--fraction", fraction, "truncation: bottom/top fraction");
  app.add_option("--steps", steps, "SGD steps per worker")->check(CLI::PositiveNumber);
  app.add_option("--interval", interval, "steps between publish points")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "minibatch size")->check(CLI::PositiveNumber);
  app.add_option("--workers", workers, "population size")->check(CLI::Range(1, 16));
  app.add_option("--seed", seed, "seed of every random choice");
  app.add_option("--lr-min", lr_min,
                 "learning rates are drawn log-uniformly from [lr-min, lr-max]");
  app.add_option("--lr-max", lr_max);
  app.add_option("--lineage", lineage, "JSON Lines file, one line per copy (appended)");
  app.add_option("--data", data, "directory with the four Fashion-MNIST IDX files");
  CLI11_PARSE(app, argc, argv);

  idx::MnistDir mnist;
  try {
    mnist = idx::readMnistDir(data);
  } catch (const idx::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  // The first 50,000 training images train, the last 10,000 score (validation).
  const at::Tensor all_x = idx::imagesAsFloatRows(mnist.train.images);
  const at::Tensor all_y = idx::labelsAsLong(mnist.train.labels);
  const at::Tensor train_x = all_x.slice(0, 0, 50000), train_y = all_y.slice(0, 0, 50000);
  const at::Tensor val_x = all_x.slice(0, 50000), val_y = all_y.slice(0, 50000);
  const at::Tensor test_x = idx::imagesAsFloatRows(mnist.test.images);
  const at::Tensor test_y = idx::labelsAsLong(mnist.test.labels);

  auto model = std::make_shared<Softmax>();
  gradagg::PopulationFns fns;
  fns.hyperparams = [&](int, gradagg::DecisionRng& rng) {
    return gradagg::Hyperparams{
        {"lr", std::exp(std::log(lr_min) + rng.uniform() * (std::log(lr_max) - std::log(lr_min)))}};
  };
  fns.make_optimizer = [](torch::nn::Module& m, const gradagg::Hyperparams& hp) {
    return std::make_unique<torch::optim::SGD>(m.parameters(),
                                               torch::optim::SGDOptions(hp.at("lr")));
  };
  fns.train_step = [&](const gradagg::MemberContext& c) {
    const auto start = static_cast<std::int64_t>(c.rng->below(50000 - static_cast<int>(batch)));
    c.optimizer->zero_grad();
    at::cross_entropy_loss(model->forward(train_x.slice(0, start, start + batch)),
                           train_y.slice(0, start, start + batch))
        .backward();
    c.optimizer->step();
  };
  fns.score = [&](const gradagg::MemberContext&) { return accuracy(*model, val_x, val_y); };

  gradagg::PopulationOptions options;
  options.workers = workers;
  options.publish_interval = interval;
  options.seed = seed;
  options.higher_is_better = true;
  options.lineage_path = lineage;
  options.policy = policy_name == "random"       ? gradagg::Policy::random(p)
                   : policy_name == "truncation" ? gradagg::Policy::truncation(fraction)
                   : policy_name == "tournament" ? gradagg::Policy::tournament()
                                                 : gradagg::Policy::none();
  gradagg::Population population(*model, fns, options);
  std::size_t copies = 0;
  for (std::int64_t done = 0; done < steps; done += interval)
    copies += population.generation().size();

  // Score every member's final snapshot on the test set, here in the parent.
  double best = 0, mean = 0;
  int best_rank = 0;
  std::printf("policy %s, %d workers, %ld steps each, %zu copies\n", options.policy.name().c_str(),
              workers, static_cast<long>(population.snapshot(0).step), copies);
  for (int r = 0; r < workers; ++r) {
    const gradagg::MemberSnapshot s = population.snapshot(r);
    Softmax m;
    m.w.data().copy_(s.parameters[0]);
    m.b.data().copy_(s.parameters[1]);
    const double test = accuracy(m, test_x, test_y);
    mean += test / workers;
    if (test > best) best = test, best_rank = r;
    std::printf("  worker %d: validation accuracy %.4f, test accuracy %.4f, lr %.6g\n", r, s.score,
                test, s.hyperparams.at("lr"));
  }
  std::printf("best test accuracy %.4f (worker %d), mean %.4f\n", best, best_rank, mean);
  return 0;
}
