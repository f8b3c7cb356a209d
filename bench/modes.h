// The bench's modes, one function each: every one trains (or reduces) one model
// as its mode says and returns the row of medians the table and the JSON show
// (bench/README.md has the columns). All take the model, its global batch and
// the run's settings; they keep no state between calls.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <gradagg/gradagg.h>

#include "models.h"
#include "placement.h"
#include "report.h"

namespace gradagg::bench {

struct Config {
  int workers = 2;
  int steps = 20;
  int warmup = 3;
  int threads = 0;                // single mode; 0: all cores
  std::string optimizer = "sgd";  // --optimizer: sgd, adam or adamw, every mode
  std::int64_t batch = 0;         // 0: the model's default
  std::vector<ModelSpec> models;
  std::set<std::string> modes;
  std::string json;
  bool check = false;
  bool short_run = false;
  int cores = 1;
  std::string reduce_dtype = "float32";  // reduce-only: float32, bf16 or fp16
  int accumulate = 1;                    // shm: micro-batches per worker and step
  std::int64_t message_bytes = 0;        // shm: a message of this many bytes with each step
  bool keep_worker_memory = true;        // shm, shm-2nodes*: Options::keep_worker_memory
  int parent_threads = gradagg::Options().parent_threads;  // shm, shm-2nodes*
  int rounds = 3;         // each model's modes run this many times in turn, steps split among them
  double quiet_cpus = 0;  // > 0: redo a round when the CPUs' spread went past this (rounds.h)
  Placement placement;    // the nodes' and Gloo peers' CPUs and network
};

// Intra-op threads of each forked peer or worker: the cores shared among them.
inline int peerThreads(const Config& cfg) { return std::max(1, cfg.cores / cfg.workers); }

using Clock = std::chrono::steady_clock;
inline double msSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The unmeasured steps that open a row of one process (single, shm): at least
// --warmup steps and at least kMinWarmupMs of them. On this 2-core VM a
// process's two threads can share one CPU for tens of ms while the other
// idles (most often right after the bench's CPU probe), until the load
// balancer moves one; the 807-parameter model's 3 warm-up steps take 0.3 ms,
// so its timed steps paid 4-8 ms each for that (docs/benchmark.md). Gloo
// peers and nodes agree on a step count in advance and keep --warmup alone.
class WarmUp {
 public:
  static constexpr double kMinWarmupMs = 200;
  explicit WarmUp(int steps) : steps_(steps), start_(Clock::now()) {}
  // True when step `s`, starting at `t0`, is still warm-up (once false, false for later steps).
  bool includes(int s, Clock::time_point t0) {
    if (done_) return false;
    done_ = s >= steps_ &&
            std::chrono::duration<double, std::milli>(t0 - start_).count() >= kMinWarmupMs;
    if (!done_) ++taken_;
    return !done_;
  }
  int taken() const { return taken_; }  // the warm-up steps run so far

 private:
  int steps_;
  Clock::time_point start_;
  bool done_ = false;
  int taken_ = 0;
};

using ModeFn = Row (*)(const ModelSpec& spec, const Data& data, const Config& cfg);

// One process's own training on (x, y), --warmup then --steps timed steps:
// zero_grad, forward and backward (compute), optimizer step. before_first_step
// runs after the model and optimizer are made (the ceiling's start barrier).
struct AloneTimes {
  std::vector<double> total, compute;
  int warmup_steps = 0;
};
AloneTimes trainAlone(const ModelSpec& spec, const torch::Tensor& x, const torch::Tensor& y,
                      const Config& cfg, const std::function<void()>& before_first_step = {});

// modes_local.cpp: one process, and gradagg's Aggregator on one node.
// runSingle trains in this process as it is (the body of --one-process).
Row runSingle(const ModelSpec& spec, const Data& data, const Config& cfg);
Row runShm(const ModelSpec& spec, const Data& data, const Config& cfg);
// shm-1node: shm with shm-2nodes' workers per node, at the same per-worker batch
// (on data of its own, half the global batch; `data` is not used).
Row runShmOneNode(const ModelSpec& spec, const Data& data, const Config& cfg);
// The shard function of the gradagg modes, over `model` and `data` (both outlive it).
gradagg::ShardFn shmShard(Net& model, const Data& data, const ModelSpec& spec);

// modes_alone.cpp: the references, each in processes of their own.
// single: a fresh process, glibc's default heap, --threads threads.
Row runSingleAsUsersRunIt(const ModelSpec& spec, const Data& data, const Config& cfg);
// single-kept: the same with the workers' heap settings (Options::keep_worker_memory).
Row runSingleKeptHeap(const ModelSpec& spec, const Data& data, const Config& cfg);
// The body of the fresh process: heap "default" or "kept", then runSingle.
Row runOneProcess(const ModelSpec& spec, const Data& data, const Config& cfg,
                  const std::string& heap);
// ceiling: --workers independent processes side by side, each a worker's
// threads and heap on its share of the batch, no communication; the slowest one's median.
Row runCeiling(const ModelSpec& spec, const Data& data, const Config& cfg);

// modes_nodes.cpp: two forked nodes of gradagg joined through c10d Gloo.
Row runNodes(const ModelSpec& spec, const Data& data, const Config& cfg);
// shm-2nodes-bf16: the float32 gradients cross as bf16 (NodeOptions::compression).
Row runNodesBf16(const ModelSpec& spec, const Data& data, const Config& cfg);
// shm-2nodes-after: the same buckets cross after backward (NodeOptions::overlap off).
Row runNodesAfter(const ModelSpec& spec, const Data& data, const Config& cfg);

// modes_gloo.cpp: forked c10d Gloo peers, DDP style.
Row runGloo(const ModelSpec& spec, const Data& data, const Config& cfg);
// One gloo step's mean gradient (the allreduced flat gradient, divided by N).
torch::Tensor glooGradient(const ModelSpec& spec, const Data& data, const Config& cfg);
// The median time of one Gloo allreduce of `count` floats among n forked
// processes with `threads` intra-op threads, over `samples` calls after 3 unmeasured ones.
double glooAllreduceMs(const Placement& placement, int n, std::size_t count, int samples,
                       int threads);

// modes_reduce.cpp: the reduction alone, and the check that shm and gloo agree.
// reduce-only: `data` is not used (no training).
Row runReduceOnly(const ModelSpec& spec, const Data& data, const Config& cfg);
Row runCheck(const ModelSpec& spec, const Data& data, const Config& cfg);

}  // namespace gradagg::bench
