// What one step did: the loss, the samples and the time spent in each phase.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace gradagg {

struct WorkerReport {
  double loss = 0;           // the loss the shard function returned (accumulating: the
                             // mean over the micro-batches, weighted as the gradient)
  std::int64_t samples = 0;  // the sample count it returned (accumulating: the sum)
  double wake_ms = 0;        // from the parent's command to this worker starting the step
  double load_ms = 0;        // loading the snapshot (buffers, clearing the slot)
  double shard_ms = 0;       // user's shard function (forward and loss; all micro-batches)
  double backward_ms = 0;    // autograd into the slot (all micro-batches)
  double write_ms = 0;       // checking the slot (shapes, finiteness), loss and buffers
  double barrier_ms = 0;     // waiting for the other workers' slots
  double reduce_ms = 0;      // summing this worker's range over all slots
  // ShardResult::metrics (summed over the micro-batches); the agreed names
  // with 0 where the worker returned none (0 samples).
  std::map<std::string, double> metrics;
};

struct StepReport {
  std::int64_t step = 0;         // the global step (Options::start_step for the first)
  double loss = 0;               // mean of the worker losses with the step's weights
  std::int64_t samples = 0;      // sum over workers
  double publish_ms = 0;         // parent: checking the snapshot (and, across nodes, the checksum)
  double compute_ms = 0;         // parent: from the command until every range is reduced
  double reduce_ms = 0;          // the slowest worker's reduce_ms (the sum runs in the workers)
  double node_ms = 0;            // across nodes: the node parents' collectives (0 on one node)
  std::uint64_t node_bytes = 0;  // across nodes: the bytes this node put into them (halved
                                 // with NodeOptions::compression = kBFloat16)
  int node_collectives = 0;      // across nodes: the allreduces the gradient and status crossed in
  int node_overlapped = 0;       // of them, buckets started while this node's workers were still
                                 // computing (NodeOptions::overlap; src/step/buckets.h)
  double apply_ms = 0;           // parent: pointing .grad at the result, buffers, this report
  double total_ms = 0;           // the whole step() call
  bool skipped = false;          // NonFinitePolicy::kSkipStep skipped this step
  int consecutive_skips = 0;     // skipped steps in a row, this one included
  std::int64_t skipped_total = 0;
  int restarts = 0;  // worker-group restarts so far (Options::max_restarts)
  // ShardResult::metrics summed over every worker (of every node).
  std::map<std::string, double> metrics;
  std::vector<WorkerReport> workers;  // by rank
};

}  // namespace gradagg
