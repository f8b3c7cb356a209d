// Placement: where this node's workers sit among all workers, the cores they
// share with other nodes' processes on the same machine, and their seed. One
// node's is its own (topology.cpp); across nodes the agreement decides it
// (rendezvous.h).
#pragma once

#include <cstdint>

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

}  // namespace gradagg::detail
