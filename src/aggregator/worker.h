// The worker side of the step protocol: what a forked child runs.
#pragma once

#include <sys/types.h>

#include <vector>

#include <gradagg/options.h>
#include <gradagg/shard.h>

#include "model/model_binding.h"
#include "runtime/segment.h"
#include "step/buckets.h"
#include "step/flat.h"
#include "step/layout.h"
#include "step/weights.h"

namespace gradagg::detail {

// Where this worker's rank sits among all workers (ShardContext's fields).
struct WorkerRanks {
  int global_offset = 0;  // workers before this group's first
  int global_workers = 0;
  int node = 0;
  int nodes = 1;
};

struct WorkerSetup {
  int rank = 0;
  int threads = 1;
  const Segment* segment = nullptr;  // inherited mapping, same address as the parent's
  Layout layout;                     // what the parent planned, to check the header against
  ModelBinding* binding = nullptr;   // this process's copy (fork): its replica's tensors
  const ModelView* model = nullptr;  // the replica
  const ShardFn* shard = nullptr;
  const Options* options = nullptr;
  WeightRule weights;           // the step's weighting, for the closer
  ByteRange range;              // this worker's range of the flat gradient
  std::uint32_t start_seq = 0;  // command_seq when this worker was forked
  pid_t parent = 0;
  WorkerRanks ranks;
  const BucketPlan* buckets = nullptr;  // early() > 0: take the bucket lines
};

// Runs in the child (ProcessSet::spawn's fresh thread) and returns its exit status.
int workerMain(const WorkerSetup& setup);

}  // namespace gradagg::detail
