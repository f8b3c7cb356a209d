// The parity demo: y = theta * x + bias fitted to y = 3x + 4 on four points,
// once by gradagg workers (each owning part of the batch) and once in this
// process on the full batch. The two must agree.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <gradagg/gradagg.h>

#include "exit_status.h"

struct LinearImpl : torch::nn::Module {
  LinearImpl() {
    theta = register_parameter("theta", torch::ones({1}));
    bias = register_parameter("bias", torch::ones({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return theta * x + bias; }
  torch::Tensor theta, bias;
};
TORCH_MODULE(Linear);

namespace {

int run(int argc, char** argv) {
  int workers = 4;
  int steps = 100;
  // Several machines: flags, or torchrun-style environment variables (see README).
  gradagg::NodeOptions nodes = gradagg::NodeOptions::fromEnvironment();
  CLI::App app{"gradagg parity demo: forked workers vs one process on y = 3x + 4"};
  app.add_option("-w,--workers", workers, "worker processes on this node (all nodes: 1..4 in all)")
      ->check(CLI::Range(1, 4));
  app.add_option("-s,--steps", steps, "SGD steps")->check(CLI::NonNegativeNumber);
  app.add_option("--nodes", nodes.nodes, "machines taking part (GRADAGG_NNODES)");
  app.add_option("--node-rank", nodes.node_rank, "this machine's rank (GRADAGG_NODE_RANK)");
  app.add_option("--master-addr", nodes.master_addr,
                 "node 0's address, for the TCPStore (MASTER_ADDR)");
  app.add_option("--master-port", nodes.master_port, "its port (MASTER_PORT)");
  app.add_option("--store", nodes.store_path,
                 "a FileStore path every node sees, instead (GRADAGG_STORE_PATH)");
  app.add_option("--ifname", nodes.interface, "network interface for Gloo (GRADAGG_SOCKET_IFNAME)");
  if (const auto done = example::parseCommandLine(app, argc, argv)) return *done;

  const auto x = torch::tensor({2.0f, 4.0f, 6.0f, 10.0f});
  const auto y = 3 * x + 4;
  const double lr = 0.01;

  // gradagg: worker r owns a contiguous share of the four samples.
  Linear model;
  torch::optim::SGD opt(model->parameters(), lr);
  gradagg::Options options;
  options.workers = workers;
  options.nodes = nodes;
  double aggregate_ms = 0;
  {
    gradagg::Aggregator agg(
        *model,
        [&](const gradagg::ShardContext& ctx) {
          // Global worker g of G owns samples [4g/G, 4(g+1)/G).
          const int64_t n = x.size(0);
          if (ctx.global_workers > n)
            throw std::invalid_argument("more workers in all than the 4 samples");
          const int64_t begin = n * ctx.global_rank / ctx.global_workers;
          const int64_t end = n * (ctx.global_rank + 1) / ctx.global_workers;
          auto xs = x.slice(0, begin, end), ys = y.slice(0, begin, end);
          return gradagg::ShardResult{torch::mse_loss(model->forward(xs), ys), end - begin};
        },
        options);
    for (int s = 0; s < steps; ++s) {
      const auto& report = agg.step();
      aggregate_ms += report.total_ms;
      opt.step();
    }
  }

  // Single process, full batch, mean loss; after the nodes trained, so that
  // the nodes meet at the rendezvous as they start, not a long run apart.
  Linear single;
  torch::optim::SGD single_opt(single->parameters(), lr);
  for (int s = 0; s < steps; ++s) {
    single_opt.zero_grad();
    torch::mse_loss(single->forward(x), y).backward();
    single_opt.step();
  }

  torch::NoGradGuard no_grad;
  const auto one = torch::ones({1});
  const double p_single = single->forward(one).item<double>();
  const double p_agg = model->forward(one).item<double>();
  const double diff = std::abs(p_single - p_agg);
  const double rel = diff / std::max(std::abs(p_single), 1e-30);
  fmt::print("prediction at x = 1 after {} steps (SGD lr {}):\n", steps, lr);
  fmt::print("  single process      : {:.12f}\n", p_single);
  if (nodes.nodes > 1)
    fmt::print("  gradagg, node {} of {}: {:.12f} ({} workers here)\n", nodes.node_rank,
               nodes.nodes, p_agg, workers);
  else
    fmt::print("  gradagg, {} workers  : {:.12f}\n", workers, p_agg);
  fmt::print("  absolute difference : {:.3e} (relative {:.3e})\n", diff, rel);
  fmt::print("  true value          : 7\n");
  fmt::print("  theta {:.9f} bias {:.9f}; gradagg steps took {:.1f} ms in all\n",
             model->theta.item<double>(), model->bias.item<double>(), aggregate_ms);
  // The exact result, for comparing with other front ends (python/examples).
  const auto bits = [](const torch::Tensor& t) {
    const float v = t.item<float>();
    std::uint32_t u = 0;
    std::memcpy(&u, &v, sizeof u);
    return u;
  };
  fmt::print("  float32 bits        : theta {:#010x} bias {:#010x}\n", bits(model->theta),
             bits(model->bias));
  if (!(rel <= 1e-6)) {
    fmt::print(stderr, "FAIL: the two trainings differ by more than 1e-6 relative\n");
    return example::kResultsDiffer;
  }
  fmt::print("OK: they agree within 1e-6 relative\n");
  return example::kDone;
}

}  // namespace

// Any error (a bad GRADAGG_* variable, a worker that dies, a node that does not
// come) ends the demo with one line and an exit code (examples/exit_status.h).
int main(int argc, char** argv) { example::runMain("linear_regression_parity", run, argc, argv); }
