// The worker side of the step protocol: what a forked child runs.
#pragma once

#include <sys/types.h>

#include <vector>

#include <gradagg/aggregator.h>

#include "core/layout.h"
#include "core/model_binding.h"
#include "core/reduce.h"
#include "core/segment.h"

namespace gradagg::detail {

struct WorkerSetup {
  int rank = 0;
  int threads = 1;
  std::uint32_t start_seq = 0;            // command_seq when this worker was forked
  const Segment* segment = nullptr;       // inherited mapping, same address as the parent's
  Layout layout;                          // what the parent planned, to check the header against
  ModelBinding* binding = nullptr;        // this process's copy (fork): its replica's tensors
  torch::nn::Module* model = nullptr;     // the replica
  const ShardFn* shard = nullptr;
  const Options* options = nullptr;
  const std::vector<FlatTensor>* flat = nullptr;  // the parameters as the reduction sees them
  ByteRange range;                        // this worker's range of the flat gradient
  pid_t parent = 0;
  // Across nodes: the reduction leaves sum_i w_i g_i unnormalised (the parent
  // divides after the allreduce), and the shard function learns its global rank.
  bool normalize = true;
  int node = 0;
  int nodes = 1;
  int worker_offset = 0;
  int global_workers = 1;
};

// Runs in the child right after fork and returns its exit status. The work runs
// on a fresh thread: libgomp's thread pool state inherited from a parent that
// already ran parallel regions hangs the forked main thread's next parallel
// region, while a new thread builds a new pool.
int workerMain(const WorkerSetup& setup) noexcept;

}  // namespace gradagg::detail
