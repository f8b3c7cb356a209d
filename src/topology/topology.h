// The topology: where this process's workers sit among all that train the
// model, and the reduction stage that combines their sum with the others'.
// The one factory below is the only place that asks how many nodes there are;
// the aggregator includes nothing else from this layer.
#pragma once

#include <cstdint>
#include <memory>

#include <gradagg/options.h>

#include "model/model_binding.h"
#include "step/stage.h"

namespace gradagg::detail {

// Where this node's workers sit among all workers.
struct Placement {
  int node = 0;
  int nodes = 1;
  int worker_offset = 0;   // workers on lower nodes
  int global_workers = 0;  // on every node
  // Workers that run on this node's cores, other nodes' on the same machine
  // and CPUs included: the default threads per worker divide the cores by it.
  int host_workers = 0;
  // Node parents on those cores, this one included.
  int host_nodes = 1;
  // The workers' seed (gradagg::workerSeed): Options::seed, or where it is
  // unset the parent's torch seed, across nodes node 0's (the rendezvous
  // decides it, like the initial parameters).
  std::uint64_t seed = 0;
};

// The default CPU generator's current seed: what torch::manual_seed set last.
std::uint64_t parentTorchSeed();

// Whether a node's parent has a core that none of the processes on these cores
// needs while it waits: every worker's threads and every node parent fit the
// cores (ParentChannel::setOwnCore: then its waits spin instead of sleeping).
inline bool parentHasOwnCore(const Placement& p, int threads_per_worker, int cores) {
  return p.host_workers * threads_per_worker + p.host_nodes <= cores;
}

struct Topology {
  Placement placement;
  std::unique_ptr<ReductionStage> stage;
};

// One node (options.nodes.nodes == 1): a LocalStage, this node's workers are
// all. Several: the rendezvous with the other node parents
// (topology/stage/rendezvous.h), then a CrossNode stage; call stage->attach() once
// the snapshot is adopted. Throws InvalidArgument (a model or settings the
// nodes cannot share) or NodeFailed (the rendezvous did not complete within
// options.nodes.timeout).
Topology joinTopology(const Options& options, ModelBinding& binding);

}  // namespace gradagg::detail
