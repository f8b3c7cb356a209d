// What the user's shard function is told and returns: the contract between a
// worker and the code it runs each step.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

#include <gradagg/message.h>

namespace gradagg {

// Where a step is in its data: the epoch and the batch's index in it, what
// `for batch_idx, batch in enumerate(loader)` counts in one epoch of a
// DataLoader. ShardedBatches::steps(epoch) lists an epoch's positions,
// Aggregator::step(position) hands one to the shard functions, and a
// checkpoint keeps the next one (TrainingState::position), so that leaving an
// epoch early or resuming never shifts which batch a step reads.
struct BatchPosition {
  std::int64_t epoch = 0;
  std::int64_t index = 0;  // 0..steps_per_epoch-1; steps_per_epoch: the epoch is done

  bool operator==(const BatchPosition& o) const { return epoch == o.epoch && index == o.index; }
  bool operator!=(const BatchPosition& o) const { return !(*this == o); }
  bool operator<(const BatchPosition& o) const {
    return epoch < o.epoch || (epoch == o.epoch && index < o.index);
  }
  // The position after this one's batch (same epoch; steps() starts the next).
  BatchPosition next() const { return {epoch, index + 1}; }
};

// The seed of LibTorch's default generator in global worker `global_rank` at
// global step `step`, given the run's seed (Options::seed, by default the
// parent's torch seed): each worker calls torch::manual_seed(workerSeed(...))
// before its shard function's first micro-batch of the step. A one-process
// reference of a run with dropout seeds the same before computing worker r's
// part (docs/how-it-works.md, "What exact means"). splitmix64's finaliser
// (Steele, Lea and Flood, 2014) of seed ^ (rank << 40) ^ step, plus the golden
// gamma; the same in Python (gradagg.worker_seed).
constexpr std::uint64_t workerSeed(std::uint64_t seed, int global_rank, std::int64_t step) {
  std::uint64_t z =
      (seed ^ (static_cast<std::uint64_t>(global_rank) << 40) ^ static_cast<std::uint64_t>(step)) +
      0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// What a shard function is told: who it is and which step it computes.
struct ShardContext {
  int rank = 0;     // 0..workers-1, on this node
  int workers = 1;  // on this node
  // The global step: Options::start_step for the first step() of this
  // Aggregator, then one more each step (a resumed run goes on counting).
  std::int64_t step = 0;
  // Across nodes (NodeOptions): pick the shard by these; equal to rank and
  // workers on a single node.
  int global_rank = 0;     // workers of lower nodes + rank
  int global_workers = 1;  // over all nodes
  int node = 0;
  int nodes = 1;
  // Gradient accumulation (Options::accumulation_steps): which micro-batch of
  // this step, 0..micro_steps-1. Pick the micro-batch by (step, micro_step).
  int micro_step = 0;
  int micro_steps = 1;
  // Where this step is in the data, as the parent gave it to step(position)
  // (ShardedBatches::batch reads that batch); empty for step() without one
  // (ShardedBatches then reads the batch of `step`, step / steps_per_epoch).
  std::optional<BatchPosition> position;
  // What the parent passed to step(message) (gradagg/message.h): read-only
  // views of the segment's copy, valid during this call. Empty for step().
  Message message;
};

// What a shard function returns: the loss of its shard (a scalar that requires
// grad; gradagg calls backward on it, so do not call backward yourself) and how
// many samples that loss averages over, used for the weighting (also between
// the micro-batches of one worker when accumulating).
//
// samples == 0: this worker has nothing to do this step (the last, uneven batch
// of an epoch). The loss may be undefined; it is not used and no backward runs.
// The step's weights are computed over the workers that have samples, so the
// result is the mean over the samples that exist. A step in which every worker
// (every node) has 0 samples is an InvalidArgument.
//
// metrics: named scalars to sum over the workers (accuracy counts, tokens, a
// phase's time): StepReport::metrics holds the sums over all workers and
// nodes, StepReport::workers[i].metrics each worker's. The names are fixed by
// the first step; a different set later is an InvalidArgument (a worker with 0
// samples may return none). At most kMaxMetrics, names of at most
// kMaxMetricNameBytes bytes.
struct ShardResult {
  ShardResult() = default;
  // ShardResult{loss, samples} or ShardResult{loss, samples, {{"correct", 12}}}.
  ShardResult(at::Tensor loss_, std::int64_t samples_ = 1,
              std::map<std::string, double> metrics_ = {})
      : loss(std::move(loss_)), samples(samples_), metrics(std::move(metrics_)) {}

  at::Tensor loss;
  std::int64_t samples = 1;
  std::map<std::string, double> metrics;

  static constexpr int kMaxMetrics = 16;
  static constexpr std::size_t kMaxMetricNameBytes = 47;
};

// Runs in a worker process, on that process's copy of the model (its replica):
// capture the model and the data by reference, they are the worker's own after fork.
// Parameters are read-only there (writing them kills the worker with SIGSEGV).
using ShardFn = std::function<ShardResult(const ShardContext&)>;

}  // namespace gradagg
