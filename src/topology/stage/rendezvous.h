// The start-up across nodes, before the first step: every node parent checks
// that the others run the same model from the same agreement, learns where its
// workers sit among everyone's, and takes node 0's initial values.
#pragma once

#include <gradagg/options.h>

#include "model/model_binding.h"
#include "topology/group/node_group.h"
#include "topology/stage/placement.h"

namespace gradagg::detail {

// The cross-node collective carries float32 and float64 runs only: a bf16 or
// fp16 parameter is an InvalidArgument before the rendezvous, so every node
// fails alike.
void requireWideDtypes(const ModelBinding& binding);

// Through the group's store: the same parameter and buffer list everywhere,
// the same agreement (Options::start_step, NodeOptions' resume_identity,
// must_match and the collectives' shape), else InvalidArgument on every node
// naming the first difference; then every node's host identity and worker
// count, from which this node's Placement follows.
Placement rendezvous(NodeGroup& group, const Options& options, const ModelBinding& binding);

// Node 0's parameters and buffers into every node's (the snapshot, once it is
// adopted).
void broadcastInitialValues(NodeGroup& group, ModelBinding& binding);

}  // namespace gradagg::detail
