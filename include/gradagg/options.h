// Options of an Aggregator: plain data with defaults, validated once at construction.
#pragma once

#include <chrono>

namespace gradagg {

// How the worker gradients are combined.
enum class Weighting {
  // w_i = n_i / sum_j n_j, with n_i the sample count the shard function reports.
  // When every shard's loss is a mean over its samples, this is exactly the
  // full-batch mean gradient, however unequal the shards are.
  kBySamples,
  // w_i = 1 / N, whatever the sample counts: what PyTorch DDP does.
  kEqual,
};

// What the parent's buffers (BatchNorm running statistics, ...) become after a step.
// Workers always start a step from the parent's buffers.
enum class BufferSync {
  kFromRank0,   // worker 0's updated buffers replace the parent's (DDP's rule)
  kMean,        // floating-point buffers: mean over workers with the step's weights;
                // other dtypes (e.g. num_batches_tracked) from worker 0
  kKeepParent,  // workers' updates are discarded; the parent's buffers stay as they are
};

struct Options {
  // Worker processes forked at construction, 1..kMaxWorkers.
  int workers = 2;
  Weighting weighting = Weighting::kBySamples;
  BufferSync buffers = BufferSync::kFromRank0;
  // Intra-op threads in each worker; 0 means max(1, cores / workers).
  int threads_per_worker = 0;
  // Deadline for every worker to finish a step (and to start up); a late worker
  // raises StepTimeout naming its rank.
  std::chrono::milliseconds step_timeout{std::chrono::minutes(5)};
  // How long shutdown waits for workers to exit before it kills them.
  std::chrono::milliseconds shutdown_timeout{std::chrono::seconds(2)};

  static constexpr int kMaxWorkers = 256;

  // Throws InvalidArgument naming the first field that is out of range.
  void validate() const;
  // threads_per_worker with 0 resolved against the cores this process may use.
  int resolvedThreadsPerWorker() const;
};

// Cores this process may run on (sched_getaffinity), at least 1.
int availableCores();

}  // namespace gradagg
