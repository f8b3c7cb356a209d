// Fashion-MNIST trained by gradagg workers: the command line, progress display
// and metrics. The training itself (model, shard function, optimizer steps,
// checkpoints) is in fashion_train.cpp; the data split is described in
// fashion_train.h.
//
//   fashion_mnist --workers 2 --epochs 5 --metrics fashion.csv
//   fashion_mnist --single --workers 2      # the same model and batches in one process
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <map>
#include <string>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "exit_status.h"
#include "fashion_train.h"
#include "idx.h"

namespace {

std::string duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "--:--";
  const auto s = static_cast<long>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

// On a terminal (isatty): one line redrawn in place. Otherwise: a plain line every tenth of an
// epoch.
class ProgressDisplay {
 public:
  ProgressDisplay() : tty_(::isatty(STDOUT_FILENO) == 1) {}

  void step(const fashion::StepProgress& p) {
    const auto every = std::max<std::int64_t>(1, p.steps_per_epoch / 10);
    const std::string stats =
        fmt::format("{}/{} steps  {:.0f} samples/s  loss {:.4f}  ETA {}", p.step_in_epoch,
                    p.steps_per_epoch, p.samples_per_s, p.epoch_loss, duration(p.eta_s));
    if (tty_) {
      // Redrawn at most ten times a second: steps take a few milliseconds.
      const auto now = std::chrono::steady_clock::now();
      if (now - drawn_ < std::chrono::milliseconds(100) && p.step_in_epoch != p.steps_per_epoch) {
        return;
      }
      drawn_ = now;
      constexpr int kWidth = 24;
      const int filled = static_cast<int>(kWidth * p.step_in_epoch / p.steps_per_epoch);
      fmt::print("\r\033[Kepoch {}/{} [{}{}] {}", p.epoch + 1, p.epochs, std::string(filled, '#'),
                 std::string(kWidth - filled, '.'), stats);
      std::fflush(stdout);
      open_ = true;
    } else if (p.step_in_epoch % every == 0 && p.step_in_epoch != p.steps_per_epoch) {
      fmt::print("epoch {}/{}  {}\n", p.epoch + 1, p.epochs, stats);
      std::fflush(stdout);
    }
  }

  // Ends the in-place line before anything else is printed.
  void clear() {
    if (open_) fmt::print("\r\033[K");
    open_ = false;
  }

 private:
  bool tty_;
  bool open_ = false;
  std::chrono::steady_clock::time_point drawn_{};
};

int run(int argc, char** argv) {
  fashion::TrainConfig config;
  std::string metrics_path;
  CLI::App app{"Fashion-MNIST, Dense(hidden, relu) -> Dense(10), trained by gradagg workers"};
  app.add_option("--data", config.data_dir,
                 "directory with the four Fashion-MNIST IDX files (.gz or plain)")
      ->capture_default_str();
  app.add_option("-w,--workers", config.workers, "worker processes")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("-e,--epochs", config.epochs, "epochs (in all, when resuming)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("-b,--batch", config.batch, "samples per worker per step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", config.lr, "learning rate (default 1e-3 with adam, 0.1 with sgd)")
      ->check(CLI::PositiveNumber);
  app.add_option("--optimizer", config.optimizer, "adam or sgd")
      ->transform(CLI::CheckedTransformer(
          std::map<std::string, fashion::OptimizerKind>{{"adam", fashion::OptimizerKind::kAdam},
                                                        {"sgd", fashion::OptimizerKind::kSgd}},
          CLI::ignore_case));
  app.add_option("--seed", config.seed, "initial weights and data order")->capture_default_str();
  app.add_option("--hidden", config.hidden, "hidden units")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--limit", config.limit, "use the first N training samples (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--single", config.single,
               "train in this process with batch workers * batch (for comparison), no gradagg");
  app.add_option("--threads", config.threads,
                 "intra-op threads per worker, or of the one process with --single "
                 "(0: gradagg's default, cores / workers; LibTorch's with --single)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--prefetch", config.prefetch,
               "each worker loads its next batch on a loader thread while it computes");
  app.add_option("--step-timeout", config.step_timeout_s, "seconds a gradagg step may take")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  config.nodes = gradagg::NodeOptions::fromEnvironment();
  app.add_option("--nodes", config.nodes.nodes, "machines taking part (GRADAGG_NNODES)");
  app.add_option("--node-rank", config.nodes.node_rank, "this machine's rank (GRADAGG_NODE_RANK)");
  app.add_option("--master-addr", config.nodes.master_addr, "node 0's address (MASTER_ADDR)");
  app.add_option("--master-port", config.nodes.master_port, "its TCPStore port (MASTER_PORT)");
  app.add_option("--store", config.nodes.store_path,
                 "a FileStore path every node sees, instead (GRADAGG_STORE_PATH)");
  app.add_option("--ifname", config.nodes.interface,
                 "network interface for Gloo (GRADAGG_SOCKET_IFNAME)");
  app.add_option("--compression", config.nodes.compression,
                 "what float32 gradients cross the nodes as: none or bf16 (GRADAGG_COMPRESSION)")
      ->transform(CLI::CheckedTransformer(
          std::map<std::string, gradagg::Compression>{{"none", gradagg::Compression::kNone},
                                                      {"bf16", gradagg::Compression::kBFloat16}},
          CLI::ignore_case));
  app.add_option("--metrics", metrics_path, "append a CSV line per epoch to FILE");
  app.add_option("--checkpoint", config.checkpoint,
                 "save model, optimizer, position and RNG to FILE after every epoch and on stop");
  app.add_option("--checkpoint-every", config.checkpoint_every, "also every N steps")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--resume", config.resume, "continue from a checkpoint (same settings)");
  app.add_option("--stop-after", config.stop_after,
                 "stop after N steps in all, as if interrupted (try --resume)")
      ->check(CLI::NonNegativeNumber);
  if (const auto done = example::parseCommandLine(app, argc, argv)) return *done;
  if (app.count("--lr") == 0 && config.optimizer == fashion::OptimizerKind::kSgd) config.lr = 0.1;

  // Ctrl-C, SIGTERM or SIGHUP: finish the step, write the checkpoint, exit
  // 128 + the signal; a second one kills.
  example::stopSignals();

  std::ofstream metrics;
  auto checkMetrics = [&] {
    if (!metrics)
      throw gradagg::FileError(
          fmt::format("--metrics: writing {} failed: {}", metrics_path, std::strerror(errno)),
          metrics_path);
  };
  if (!metrics_path.empty()) {
    std::ifstream existing(metrics_path);
    const bool has_header = existing.peek() != std::ifstream::traits_type::eof();
    existing.close();
    metrics.open(metrics_path, std::ios::app);
    checkMetrics();
    if (!has_header) {
      metrics << "epoch,train_loss,test_loss,test_accuracy,train_seconds,epoch_seconds,"
                 "samples_per_s,mode,workers,batch,train_accuracy\n";
      metrics.flush();
      checkMetrics();
    }
  }

  ProgressDisplay display;
  fashion::TrainCallbacks callbacks;
  callbacks.on_info = [&](const std::string& line) {
    fmt::print("{}\n", line);
    std::fflush(stdout);  // the set-up lines show before a rendezvous that may fail
  };
  callbacks.on_step = [&](const fashion::StepProgress& p) { display.step(p); };
  callbacks.on_epoch = [&](const fashion::EpochResult& r) {
    display.clear();
    fmt::print(
        "epoch {}/{}  train loss {:.4f}  train accuracy {:.4f}  test loss {:.4f}  "
        "test accuracy {:.4f}  {:.1f} s ({:.1f} s training, {:.0f} samples/s)\n",
        r.epoch + 1, config.epochs, r.train_loss, r.train_accuracy, r.test_loss, r.test_accuracy,
        r.epoch_seconds, r.train_seconds, r.samples_per_s);
    std::fflush(stdout);
    if (metrics.is_open()) {
      metrics << fmt::format("{},{:.6f},{:.6f},{:.4f},{:.3f},{:.3f},{:.1f},{},{},{},{:.4f}\n",
                             r.epoch + 1, r.train_loss, r.test_loss, r.test_accuracy,
                             r.train_seconds, r.epoch_seconds, r.samples_per_s,
                             config.single ? "single" : "gradagg", config.workers, config.batch,
                             r.train_accuracy);
      metrics.flush();
      checkMetrics();  // a full disk ends the run (exit 4); the last checkpoint stays
    }
  };
  bool told = false;
  callbacks.around_save = [](const std::function<void()>& save) {
    auto hold = example::stopSignals().hold();  // a second Ctrl-C waits until the file is in place
    save();
  };
  callbacks.should_stop = [&] {
    if (example::stopSignal() != 0 && !told) {
      display.clear();
      fmt::print("interrupted: stopping after this step{}\n",
                 config.checkpoint.empty() ? "" : ", checkpoint in " + config.checkpoint);
      told = true;
    }
    return example::stopSignal() != 0;
  };

  const fashion::TrainResult result = fashion::train(config, callbacks);
  display.clear();
  if (result.stopped) {
    fmt::print("stopped after step {}{}\n", result.steps,
               config.checkpoint.empty() ? "" : "; resume with --resume " + config.checkpoint);
    return example::stopSignal() != 0 ? 128 + example::stopSignal() : example::kDone;
  }
  if (!result.epochs.empty()) {
    fmt::print("done: {} epochs, test accuracy {:.4f}\n", config.epochs,
               result.epochs.back().test_accuracy);
  }
  return example::kDone;
}

int runOrExplain(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const idx::Error& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    std::fprintf(stderr,
                 "Fashion-MNIST comes with Debian's %s package (apt-get install %s), which puts "
                 "it in %s;\n--data DIR reads another copy of the four files.\n",
                 idx::kDebianFashionMnistPackage, idx::kDebianFashionMnistPackage,
                 idx::kDebianFashionMnistDir);
    return example::kBadInput;
  } catch (const std::exception& e) {
    return example::fail("fashion_mnist", e);
  }
}

}  // namespace

int main(int argc, char** argv) { example::exitNow(runOrExplain(argc, argv)); }
