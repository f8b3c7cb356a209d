// gradagg-checkpoint-pause: what a checkpoint costs the training thread.
// The size of pytorch/examples' MNIST state (its Net, 1.2M float32 parameters,
// and two optimizer buffers per parameter: 14.4 MB; Adam here, as LibTorch
// 1.13 has no Adadelta), saved again and again:
//   torch::save      the model and the optimizer, each with torch::save into a
//                    file (what a LibTorch program does; no fsync);
//   save (pause)     gradagg::Checkpoint::save until it returns: the content
//                    serialised in memory; the writer thread does the rest;
//   save + wait      until the file is written, fsync'ed and renamed.
// Median, min and max of --runs each, in milliseconds. Never run by CI.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <gradagg/blas.h>
#include <gradagg/checkpoint.h>

namespace {

struct MnistNet : torch::nn::Module {
  MnistNet()
      : conv1(register_module("conv1", torch::nn::Conv2d(1, 32, 3))),
        conv2(register_module("conv2", torch::nn::Conv2d(32, 64, 3))),
        fc1(register_module("fc1", torch::nn::Linear(9216, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(conv2(torch::relu(conv1(x))));
    x = torch::flatten(torch::max_pool2d(x, 2), 1);
    return torch::log_softmax(fc2(torch::relu(fc1(x))), 1);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};

using Clock = std::chrono::steady_clock;

double millisSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

struct Stats {
  double min, median, max;
};
Stats statsOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2], v.back()};
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 10;
  std::string dir = std::filesystem::temp_directory_path().string();
  CLI::App app{"What a gradagg::Checkpoint save costs the training thread, against torch::save"};
  app.add_option("--runs", runs, "saves of each kind")->check(CLI::Range(3, 1000));
  app.add_option("--dir", dir, "where the files go (removed afterwards)");
  CLI11_PARSE(app, argc, argv);

  torch::manual_seed(1);
  auto net = std::make_shared<MnistNet>();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  auto x = torch::randn({64, 1, 28, 28});
  auto y = torch::randint(10, {64});
  torch::nll_loss(net->forward(x), y).backward();
  opt.step();  // Adam's state exists now
  std::int64_t numel = 0;
  for (const auto& p : net->parameters()) numel += p.numel();

  const std::string model_file = dir + "/gradagg-pause-model.pt";
  const std::string opt_file = dir + "/gradagg-pause-optimizer.pt";
  const std::string ckpt_file = dir + "/gradagg-pause.ckpt";
  std::vector<double> plain, pause, whole;
  {
    const gradagg::Checkpoint ckpt(ckpt_file);
    gradagg::TrainingState state;
    for (int i = 0; i < runs; ++i) {
      auto t = Clock::now();
      torch::save(net, model_file);
      torch::save(opt, opt_file);
      plain.push_back(millisSince(t));

      state.step = i;
      t = Clock::now();
      ckpt.save(*net, opt, state);
      pause.push_back(millisSince(t));
      ckpt.wait();
      whole.push_back(millisSince(t));
    }
  }
  const auto bytes = std::filesystem::file_size(ckpt_file);
  for (const auto& f : {model_file, opt_file, ckpt_file}) std::filesystem::remove(f);

  const auto blas = gradagg::blasInfo();
  fmt::print(
      "state: MNIST Net, {} float32 parameters + Adam, checkpoint {:.1f} MB; "
      "blas: {}; {} runs, in {}\n",
      numel, static_cast<double>(bytes) / 1e6, blas.vendor, runs, dir);
  fmt::print("{:<32} {:>9} {:>9} {:>9}\n", "", "min ms", "median", "max");
  auto row = [](const char* name, const Stats& s) {
    fmt::print("{:<32} {:>9.1f} {:>9.1f} {:>9.1f}\n", name, s.min, s.median, s.max);
  };
  const Stats a = statsOf(plain), b = statsOf(pause), c = statsOf(whole);
  row("torch::save (model, optimizer)", a);
  row("Checkpoint::save, the pause", b);
  row("Checkpoint::save + wait()", c);
  fmt::print("pause / torch::save, medians: {:.2f}\n", b.median / a.median);
  return 0;
}
