// CrossNode: the step's second level when a run spans several machines.
//
// Inside a node the workers reduce through shared memory as always, but with
// unnormalised weights (n_i, or 1 for equal weighting), so this node's result
// holds sum_i n_i * g_i. The node parents then allreduce, in this order, every
// step and on every node alike:
//   1. the status line: failed and non-finite counts, the weight total D, the
//      weighted loss, the samples and one has-grad count per parameter; if any
//      node failed, every node refuses the step (nothing is applied anywhere);
//   2. the result, in runs of parameters of one dtype (unflagged ones zeroed);
//   3. with BufferSync::kFromRank0, the buffers (node 0's, the others send zeros).
// Each node then divides by the global D. Gloo's ring gives every node the same
// bits, so every node takes the same optimizer step.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include <gradagg/options.h>

#include "core/layout.h"
#include "core/model_binding.h"
#include "multinode/node_group.h"
#include "core/reduce.h"

namespace gradagg::detail {

class CrossNode {
 public:
  // Rendezvous, then: the same model layout on every node (else InvalidArgument
  // on every node), worker counts exchanged, parameters and buffers broadcast
  // from node 0 into this node's snapshot.
  CrossNode(const NodeOptions& options, ModelBinding& binding, const Layout& layout,
            std::byte* base, int workers);

  int node() const { return group_.rank(); }
  int nodes() const { return group_.size(); }
  int workerOffset() const { return worker_offset_; }
  int globalWorkers() const { return global_workers_; }

  struct Status {
    int failed = 0;      // nodes with a failed worker
    int non_finite = 0;  // nodes with a non-finite gradient
    double total = 0;    // global weight total D
    double loss = 0;     // global weighted mean loss
    std::int64_t samples = 0;
  };
  // Step 1. `any_grad` (per parameter, this node's flags) becomes the global OR.
  Status exchangeStatus(bool failed, bool non_finite, double total, double weighted_loss,
                        std::int64_t samples, std::vector<std::uint8_t>& any_grad);
  // Step 2, on the result region `result` (index 0 or 1) after exchangeStatus.
  void reduceResult(int result, const std::vector<std::uint8_t>& local_any,
                    const std::vector<std::uint8_t>& global_any, double total);
  // Step 3: node 0's buffers (worker 0's, in `slot0_buffers`) into scratch; apply with commitBuffers.
  void gatherBuffers(const std::byte* slot0_buffers);
  void commitBuffers();
  // Every `interval` steps: the nodes' parameter checksums must agree (NodeFailed otherwise).
  void checkParameters(std::int64_t step);

 private:
  NodeGroup group_;
  ModelBinding& binding_;
  Layout layout_;
  std::byte* base_;
  int worker_offset_ = 0;
  int global_workers_ = 0;
  struct Span {
    std::uint64_t offset = 0;  // bytes, in the flat gradient
    at::Tensor view[2];        // over each result region
  };
  std::vector<Span> spans_;    // runs of one dtype covering every parameter
  at::Tensor status_;          // float64 [5 + parameters]
  std::vector<at::Tensor> scratch_;  // one per buffer
};

}  // namespace gradagg::detail
