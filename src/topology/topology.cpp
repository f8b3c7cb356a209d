#include "topology/topology.h"

#include "topology/stage/cross_node.h"

namespace gradagg::detail {

Topology joinTopology(const Options& options, ModelBinding& binding) {
  Topology t;
  const int workers = options.workers;
  if (options.nodes.nodes > 1) {
    auto stage = std::make_unique<CrossNode>(options, binding);
    t.placement = stage->placement();
    t.stage = std::move(stage);
    return t;
  }
  t.placement.global_workers = workers;
  t.placement.seed = options.seed ? *options.seed : parentTorchSeed();
  t.placement.host_workers = workers;
  t.stage = std::make_unique<LocalStage>();
  return t;
}

}  // namespace gradagg::detail
