// The worker side of the step protocol: what a forked child runs.
#pragma once

#include <sys/types.h>

#include <vector>

#include <gradagg/options.h>
#include <gradagg/shard.h>

#include "core/buckets.h"
#include "core/layout.h"
#include "core/model_binding.h"
#include "core/reduce.h"
#include "core/segment.h"
#include "core/stage.h"

namespace gradagg::detail {

struct WorkerSetup {
  int rank = 0;
  int threads = 1;
  const Segment* segment = nullptr;  // inherited mapping, same address as the parent's
  Layout layout;                     // what the parent planned, to check the header against
  ModelBinding* binding = nullptr;   // this process's copy (fork): its replica's tensors
  const ModelView* model = nullptr;  // the replica
  const ShardFn* shard = nullptr;
  const Options* options = nullptr;
  const std::vector<FlatTensor>* flat = nullptr;  // the parameters as the reduction sees them
  ByteRange range;                                // this worker's range of the flat gradient
  std::uint32_t start_seq = 0;                    // command_seq when this worker was forked
  pid_t parent = 0;
  Placement placement;  // among every node's workers
  const BucketPlan* buckets = nullptr;  // across nodes; early() > 0: take the bucket lines
};

// Runs in the child (ProcessSet::spawn's fresh thread) and returns its exit status.
int workerMain(const WorkerSetup& setup);

}  // namespace gradagg::detail
