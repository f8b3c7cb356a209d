// The Aggregator: forked workers compute gradients of their shards, the parent
// gets the full-batch mean gradient in its model's .grad, then steps its optimizer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include <gradagg/options.h>
#include <gradagg/step_report.h>

namespace torch::nn {
class Module;
}

namespace gradagg {

// What a shard function is told: who it is and which step it computes.
struct ShardContext {
  int rank = 0;            // 0..workers-1, on this node
  int workers = 1;         // on this node
  std::int64_t step = 0;   // 0 for the first step
  // Across nodes (NodeOptions): pick the shard by these; equal to rank and
  // workers on a single node.
  int global_rank = 0;     // workers of lower nodes + rank
  int global_workers = 1;  // over all nodes
  int node = 0;
  int nodes = 1;
};

// What a shard function returns: the loss of its shard (a scalar that requires
// grad; gradagg calls backward on it, so do not call backward yourself) and how
// many samples that loss averages over (> 0), used for the weighting.
struct ShardResult {
  at::Tensor loss;
  std::int64_t samples = 1;
};

// Runs in a worker process, on that process's copy of the model (its replica):
// capture the model and the data by reference, they are the worker's own after fork.
// Parameters are read-only there (writing them kills the worker with SIGSEGV).
using ShardFn = std::function<ShardResult(const ShardContext&)>;

class Aggregator {
 public:
  // Moves the model's parameters and buffers into a shared segment (the model
  // keeps its tensors, now viewing shared memory), then forks options.workers
  // workers and waits until they are ready. The model must outlive the Aggregator.
  // Throws InvalidArgument for a model it cannot serve (CUDA, sparse or
  // unsupported dtype parameters) or bad options.
  Aggregator(torch::nn::Module& model, ShardFn shard, Options options = {});
  // Stops and reaps the workers and gives the model its own memory back.
  ~Aggregator();
  Aggregator(Aggregator&&) noexcept;
  Aggregator& operator=(Aggregator&&) noexcept;
  Aggregator(const Aggregator&) = delete;
  Aggregator& operator=(const Aggregator&) = delete;

  // One step: every worker runs the shard function on the current parameters
  // and buffers, and each parameter's .grad becomes the weighted mean gradient
  // (undefined where no worker produced one). Call optimizer.step() after it.
  // On any error nothing is changed: not the parameters, not .grad, not the buffers.
  // The report is reused by the next step.
  const StepReport& step();

  // Stops the workers (idempotent). step() afterwards throws NotUsable.
  void shutdown();

  bool usable() const noexcept;
  int workers() const noexcept;
  std::int64_t stepsDone() const noexcept;
  const Options& options() const noexcept;
  // The workers' process ids by rank (empty when not usable), e.g. for monitoring.
  std::vector<int> workerPids() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradagg
