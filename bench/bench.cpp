// gradagg-bench: the same model and global batch trained, side by side in one
// run, by
//   single       one process as users run it, a fresh one (forward, backward,
//                optimizer step), and single-kept with the workers' heap settings;
//   ceiling      N independent processes side by side on their shares, no
//                communication: what any split can reach;
//   shm          gradagg::Aggregator with N forked workers, then optimizer.step();
//   gloo         N forked peers, DDP style: each computes its shard's gradient
//                into one flat buffer, c10d ProcessGroupGloo allreduce, divide
//                by N, each steps its own optimizer;
// and the reduction alone (reduce-only): N slots of P floats summed by gradagg's
// kernel, next to a streaming c = a + b over as many bytes and a Gloo allreduce
// of the same buffer. --check compares one step's mean gradient of shm and gloo.
// This file reads the command line, runs each model's modes in rounds (rounds.h) and
// writes the rows. See bench/README.md for the columns.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/version.h>
#include <CLI/CLI.hpp>

#include "modes.h"
#include "rounds.h"

namespace gradagg::bench {
namespace {

// ---- the command line -----------------------------------------------------------

// What the command line gives beyond Config: the lists as typed, and the
// options --short changes when they are not given.
struct Cli {
  std::string models = "all", modes = "all";
  std::string one_process;  // --one-process: the fresh process of single / single-kept
  CLI::Option* steps = nullptr;
  CLI::Option* warmup = nullptr;
  CLI::Option* rounds = nullptr;
};

// The options, in the order --help lists them: first what runs and how much of it,
void addWhatRuns(CLI::App& app, Config& cfg, Cli& cli) {
  app.add_option("-w,--workers", cfg.workers, "worker processes for shm, gloo and reduce-only")
      ->check(CLI::Range(1, gradagg::Options::kMaxWorkers));
  cli.steps = app.add_option("-s,--steps", cfg.steps, "measured steps per configuration")
                  ->check(CLI::PositiveNumber);
  cli.warmup = app.add_option("--warmup", cfg.warmup,
                              "unmeasured steps first (single, shm: and at least 200 ms)")
                   ->check(CLI::NonNegativeNumber);
  cli.rounds = app.add_option("--rounds", cfg.rounds,
                              "run each model's modes this many times in turn (single, shm, "
                              "gloo, ..., single, shm, ...), the steps split among the rounds, "
                              "each round with its own warm-up; a row is the median round and "
                              "its speedup the median of the rounds' (default 3; --short 1)")
                   ->check(CLI::Range(1, 100));
  app.add_option("-m,--model", cli.models,
                 "comma list of all (the four MLPs), 807, 55k, 670k, 5.8m, 23m (for reduce-only), "
                 "layer lists like 784-64-64-10, real (the next three), cnn, transformer, lstm");
  app.add_option("-b,--batch", cfg.batch,
                 "global batch for every model (default 16 for 807, 64 for cnn, 8 for "
                 "transformer, 16 for lstm, 256 otherwise)")
      ->check(CLI::PositiveNumber);
  app.add_option("-t,--threads", cfg.threads,
                 "intra-op threads in single mode (default: all cores)")
      ->check(CLI::PositiveNumber);
  app.add_option("--optimizer", cfg.optimizer,
                 "torch::optim optimizer of every mode: sgd (lr 0.01), adam or adamw (their "
                 "defaults)")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}));
  // How single and single-kept run: this program again, on one model.
  app.add_option("--one-process", cli.one_process)
      ->check(CLI::IsMember({"default", "kept"}))
      ->group("");
  app.add_option("--modes", cli.modes,
                 "comma list of single, single-kept, ceiling, shm, gloo, shm-1node, shm-2nodes, "
                 "shm-2nodes-bf16, "
                 "shm-2nodes-after (overlap off), reduce-only (default all)");
}

// then how the modes run and where the rows go.
void addHowItRuns(CLI::App& app, Config& cfg) {
  app.add_flag("--pin", cfg.placement.pin,
               "give each node (shm-2nodes*) and each Gloo peer its own part of the CPUs "
               "(sched_setaffinity), as taskset per node would");
  app.add_option("--cluster", cfg.placement.cluster,
                 "run the nodes and Gloo peers in an emulated cluster's namespaces (the prefix "
                 "`tests/cluster/cluster.sh up 2 RATE` prints), over its limited link");
  app.add_option("--quiet-cpus", cfg.quiet_cpus,
                 "run a round again (up to 3 times) when one CPU ran more than this many times "
                 "slower than another before any of its modes or after its last (0: never)")
      ->check([](const std::string& value) {
        const std::string wrong = "0 (never) or a spread of 1 or more, e.g. 1.15";
        try {
          const double x = std::stod(value);
          return x == 0 || (x >= 1 && x < 1e6) ? std::string() : wrong;
        } catch (const std::exception&) {
          return wrong;
        }
      });
  app.add_option("--json", cfg.json, "write one JSON object per configuration (JSON Lines) here");
  app.add_option("--accumulate", cfg.accumulate,
                 "shm: each worker's share of the batch as this many micro-batches, accumulated "
                 "(Options::accumulation_steps)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--parent-threads", cfg.parent_threads,
                 "shm, shm-2nodes*: the parent's threads (Options::parent_threads, default 1; "
                 "-1: every core; 0: as the bench runs)")
      ->check(CLI::Range(-1, 1024));
  app.add_option("--message-bytes", cfg.message_bytes,
                 "shm: step(message) with one float32 tensor of this many bytes (0: step())")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  app.add_flag("!--glibc-worker-heap", cfg.keep_worker_memory,
               "shm and shm-2nodes*: workers with glibc's malloc settings as inherited at fork "
               "(Options::keep_worker_memory = false)");
  app.add_option("--reduce-dtype", cfg.reduce_dtype,
                 "element type of the reduce-only slots: float32, bf16 or fp16")
      ->check(CLI::IsMember({"float32", "bf16", "fp16"}));
  app.add_flag("--short", cfg.short_run,
               "CI smoke run: 3 steps, 1 warm-up, only the 807 and 55k models");
  app.add_flag("--check", cfg.check,
               "also compare one step's mean gradient of shm and gloo on the 807 and 55k models; "
               "exit 1 if they differ");
}

std::vector<ModelSpec> parseModelOption(const std::string& list) {
  try {
    return parseModels(list);
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError("--model", e.what());
  }
}

std::set<std::string> parseModeOption(const std::string& list) {
  const std::vector<std::string> names = modeNames();
  std::set<std::string> modes;
  for (const std::string& name : split(list, ',')) {
    if (name == "all") {
      modes.insert(names.begin(), names.end());
    } else if (std::find(names.begin(), names.end(), name) != names.end()) {
      modes.insert(name);
    } else {
      std::string expected;  // "single, shm, ..., reduce-only"
      for (const std::string& n : names) expected += (expected.empty() ? "" : ", ") + n;
      throw CLI::ValidationError("--modes", "'" + name + "': expected " + expected + " or all");
    }
  }
  return modes;
}

// Fills `cfg` from the command line; returns the exit status when the run ends
// there (--help, a bad option).
std::optional<int> parseCommandLine(int argc, char** argv, Config& cfg, Cli& cli) {
  CLI::App app{
      "gradagg-bench: single process vs gradagg (shm) vs forked Gloo peers, and the "
      "reduction alone; one markdown row per (model, mode)"};
  addWhatRuns(app, cfg, cli);
  addHowItRuns(app, cfg);
  try {
    app.parse(argc, argv);
    if (cfg.short_run) {
      if (!cli.steps->count()) cfg.steps = 3;
      if (!cli.warmup->count()) cfg.warmup = 1;
      if (!cli.rounds->count()) cfg.rounds = 1;
      if (cli.models == "all") cli.models = "807,55k";
    }
    cfg.models = parseModelOption(cli.models);
    cfg.modes = parseModeOption(cli.modes);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return std::nullopt;
}

// The defaults that depend on the machine and the other options.
void resolve(Config& cfg) {
  if (cfg.threads == 0) cfg.threads = cfg.cores;
  for (ModelSpec& spec : cfg.models)
    if (cfg.batch > 0) spec.batch = cfg.batch;
  for (const ModelSpec& spec : cfg.models)
    if (spec.batch < cfg.workers)
      throw std::invalid_argument("batch " + std::to_string(spec.batch) + " of model " + spec.name +
                                  " is smaller than --workers " + std::to_string(cfg.workers));
}

// ---- the rows ---------------------------------------------------------------------

// Where the rows go: progress on stderr as each comes, a JSON line each
// (--json), and the table at the end.
class Recorder {
 public:
  Recorder(const std::string& json_path, const Machine& machine) : machine_(machine) {
    if (json_path.empty()) return;
    json_.open(json_path, std::ios::trunc);
    if (!json_) throw std::runtime_error("cannot write " + json_path);
  }

  void record(Row row) {
    if (row.mode != "check" && row.mode.rfind("reduce-only", 0) != 0 && row.ms_per_step > 0)
      row.samples_per_s = 1000.0 * static_cast<double>(row.batch) / row.ms_per_step;
    std::cerr << "  " << row.model << " " << row.mode << ": " << row.ms_per_step << " ms\n";
    rows_.push_back(row);
    if (json_.is_open()) json_ << toJsonLine(row, machine_) << "\n" << std::flush;
  }

  const std::vector<Row>& rows() const { return rows_; }

 private:
  Machine machine_;
  std::ofstream json_;
  std::vector<Row> rows_;
};

void printHeader(const Machine& machine, int argc, char** argv, const Config& cfg) {
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  printMachine(std::cout, machine, command);
  std::cout << "workers " << cfg.workers << ", " << cfg.steps << " steps after " << cfg.warmup
            << " warm-up in " << cfg.rounds << " round(s), single-process threads " << cfg.threads
            << ", peer threads " << peerThreads(cfg) << "\n\n"
            << std::flush;
}

// --check on the 807 and 55k models; true when shm and gloo agree on both.
bool runChecks(const Config& cfg, Recorder& out) {
  bool all_ok = true;
  for (const char* name : {"807", "55k"}) {
    ModelSpec spec = parseModel(name);
    if (cfg.batch > 0) spec.batch = cfg.batch;
    Row row = runCheck(spec, makeData(spec), cfg);
    all_ok = all_ok && row.ok.value_or(false);
    out.record(row);
  }
  return all_ok;
}

int run(int argc, char** argv) {
  Config cfg;
  Cli cli;
  cfg.cores = gradagg::availableCores();
  if (const std::optional<int> status = parseCommandLine(argc, argv, cfg, cli)) return *status;
  resolve(cfg);
  const Machine machine = probeMachine(TORCH_VERSION, cfg.optimizer);
  if (!cli.one_process.empty()) {  // single's fresh process: one row on stdout
    const ModelSpec& spec = cfg.models.at(0);
    std::cout << toJsonLine(runOneProcess(spec, makeData(spec), cfg, cli.one_process), machine)
              << "\n";
    return 0;
  }
  printHeader(machine, argc, argv, cfg);
  Recorder out(cfg.json, machine);
  for (const ModelSpec& spec : cfg.models)
    for (Row& row : runModel(spec, cfg)) out.record(std::move(row));
  const bool all_ok = !cfg.check || runChecks(cfg, out);
  std::cout << "\n";
  printTable(std::cout, out.rows());
  if (!all_ok) {
    std::cout << "FAILED: shm and gloo gradients differ by more than 1e-5 relative\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace gradagg::bench

int main(int argc, char** argv) {
  try {
    return gradagg::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "gradagg-bench: " << e.what() << "\n";
    return 2;
  }
}
