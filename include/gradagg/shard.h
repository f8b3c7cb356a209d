// What the user's shard function is told and returns: the contract between a
// worker and the code it runs each step.
#pragma once

#include <cstdint>
#include <functional>

#include <ATen/core/Tensor.h>

namespace gradagg {

// What a shard function is told: who it is and which step it computes.
struct ShardContext {
  int rank = 0;           // 0..workers-1, on this node
  int workers = 1;        // on this node
  std::int64_t step = 0;  // 0 for the first step
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
};

// What a shard function returns: the loss of its shard (a scalar that requires
// grad; gradagg calls backward on it, so do not call backward yourself) and how
// many samples that loss averages over (> 0), used for the weighting (also
// between the micro-batches of one worker when accumulating).
struct ShardResult {
  at::Tensor loss;
  std::int64_t samples = 1;
};

// Runs in a worker process, on that process's copy of the model (its replica):
// capture the model and the data by reference, they are the worker's own after fork.
// Parameters are read-only there (writing them kills the worker with SIGSEGV).
using ShardFn = std::function<ShardResult(const ShardContext&)>;

}  // namespace gradagg
