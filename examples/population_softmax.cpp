// Population-based training of softmax regression on Fashion-MNIST (issue #5):
// 4 workers, each with its own [784, 10] weight, [10] bias, SGD and a learning
// rate drawn log-uniformly; every --interval steps each publishes its weights
// and validation accuracy, and a policy decides whether it copies a peer.
//
//   population_softmax --policy random --p 0.15 --steps 2000 --lineage lineage.jsonl
//   population_softmax --policy truncation | tournament | none
//   population_softmax --checkpoint pop.ckpt      # Ctrl-C, then:
//   population_softmax --resume pop.ckpt --checkpoint pop.ckpt
// Errors end it with one line and an exit code (exit_status.h).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>
#include <CLI/CLI.hpp>

#include <gradagg/checkpoint.h>
#include <gradagg/population.h>

#include "exit_status.h"

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

int run(int argc, char** argv) {
  std::string policy_name = "random", lineage, data = "/usr/share/datasets/fashion-mnist";
  std::string checkpoint_path, resume;
  double p = 0.15, fraction = 0.25, lr_min = 1e-4, lr_max = 1.0, step_timeout_s = 300;
  std::int64_t steps = 2000, interval = 100, batch = 64, checkpoint_every = 0;
  std::uint64_t seed = 1;
  int workers = 4;
  CLI::App app{"gradagg population mode: PBT of softmax regression on Fashion-MNIST"};
  app.add_option("--policy", policy_name, "random, truncation, tournament or none")
      ->check(CLI::IsMember({"random", "truncation", "tournament", "none"}));
  app.add_option("--p", p, "random: probability of copying a random peer")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--fraction", fraction, "truncation: bottom/top fraction")
      ->check(CLI::Range(0.0, 0.5));
  app.add_option("--steps", steps, "SGD steps per worker")->check(CLI::PositiveNumber);
  app.add_option("--interval", interval, "steps between publish points")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "minibatch size")->check(CLI::PositiveNumber);
  app.add_option("--workers", workers, "population size")->check(CLI::Range(1, 16));
  app.add_option("--seed", seed, "seed of every random choice");
  app.add_option("--lr-min", lr_min, "learning rates are drawn log-uniformly from [lr-min, lr-max]")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr-max", lr_max)->check(CLI::PositiveNumber);
  app.add_option("--lineage", lineage, "JSON Lines file, one line per copy (appended)");
  app.add_option("--data", data, "directory with the four Fashion-MNIST IDX files");
  app.add_option("--step-timeout", step_timeout_s,
                 "seconds a member may take for one phase of a generation (a stopped or hung "
                 "member ends the run after it)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--checkpoint", checkpoint_path,
                 "write the whole population to FILE at the end and when stopped (Ctrl-C, "
                 "SIGTERM, SIGHUP)");
  app.add_option("--checkpoint-every", checkpoint_every,
                 "also write it every N steps (rounded up to a publish point)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--resume", resume, "start every member from a --checkpoint file");
  if (const auto done = example::parseCommandLine(app, argc, argv)) return *done;
  if (lr_min > lr_max)
    throw std::invalid_argument(fmt::format("--lr-min {} is above --lr-max {}", lr_min, lr_max));
  // Checked now, not when the first checkpoint is due.
  std::optional<gradagg::Checkpoint> checkpoint;
  if (!checkpoint_path.empty()) checkpoint.emplace(checkpoint_path);
  example::stopSignals();

  idx::MnistDir mnist;
  try {
    mnist = idx::readMnistDir(data);
  } catch (const idx::Error& e) {
    std::fprintf(stderr, "population_softmax: %s\n", e.what());
    return example::kBadInput;
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
  options.resume_from = resume;
  options.step_timeout =
      std::chrono::milliseconds(static_cast<std::int64_t>(step_timeout_s * 1000));
  options.policy = policy_name == "random"       ? gradagg::Policy::random(p)
                   : policy_name == "truncation" ? gradagg::Policy::truncation(fraction)
                   : policy_name == "tournament" ? gradagg::Policy::tournament()
                                                 : gradagg::Policy::none();
  gradagg::Population population(*model, fns, options);
  std::size_t copies = 0;
  // A resumed population goes on from its members' step.
  // A second Ctrl-C while a checkpoint is written waits until the file is in place.
  auto save = [&] {
    auto hold = example::stopSignals().hold();
    population.checkpoint(checkpoint->path());
  };
  std::int64_t saved_at = population.snapshot(0).step;
  const std::int64_t first_step = saved_at;
  // Members' throughput: the generations' wall time alone (no data loading, saving or testing).
  std::chrono::steady_clock::duration training{};
  for (std::int64_t done = population.snapshot(0).step; done < steps; done += interval) {
    const auto started = std::chrono::steady_clock::now();
    copies += population.generation().size();
    training += std::chrono::steady_clock::now() - started;
    if (checkpoint && checkpoint_every > 0 && done + interval - saved_at >= checkpoint_every &&
        done + interval < steps) {
      save();
      saved_at = done + interval;
    }
    if (example::stopSignal() != 0) {
      if (checkpoint) save();
      std::printf("stopped at step %ld%s\n", static_cast<long>(population.snapshot(0).step),
                  checkpoint ? ("; resume with --resume " + checkpoint->path()).c_str() : "");
      return 128 + example::stopSignal();
    }
  }
  if (checkpoint) save();
  const double seconds = std::chrono::duration<double>(training).count();
  const std::int64_t trained = population.snapshot(0).step - first_step;
  std::fprintf(stderr,
               "trained %ld steps per member in %.2f s of generations: %.1f steps/s per member\n",
               static_cast<long>(trained), seconds, seconds > 0 ? trained / seconds : 0.0);

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
  return example::kDone;
}

}  // namespace

int main(int argc, char** argv) { example::runMain("population_softmax", run, argc, argv); }
