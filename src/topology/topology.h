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
#include "topology/stage/placement.h"

namespace gradagg::detail {

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
