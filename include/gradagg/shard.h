// What the user's shard function is told and returns: the contract between a
// worker and the code it runs each step.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

#include <gradagg/message.h>

namespace gradagg {

// What a shard function is told: who it is and which step it computes.
struct ShardContext {
  int rank = 0;           // 0..workers-1, on this node
  int workers = 1;        // on this node
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
  ShardResult(at::Tensor loss, std::int64_t samples = 1,
              std::map<std::string, double> metrics = {})
      : loss(std::move(loss)), samples(samples), metrics(std::move(metrics)) {}

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
