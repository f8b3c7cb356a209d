#include "topology/topology.h"

#include "topology/cross_node.h"

namespace gradagg::detail {

Topology joinTopology(const NodeOptions& options, BufferSync buffers, ModelBinding& binding,
                      int workers) {
  Topology t;
  if (options.nodes > 1) {
    auto stage = std::make_unique<CrossNode>(options, buffers, binding, workers);
    t.placement = stage->placement();
    t.stage = std::move(stage);
    return t;
  }
  t.placement.global_workers = workers;
  t.placement.host_workers = workers;
  t.stage = std::make_unique<LocalStage>();
  return t;
}

}  // namespace gradagg::detail
