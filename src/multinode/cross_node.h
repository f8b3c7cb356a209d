// CrossNode: the reduction's second stage when a run spans several machines.
//
// Inside a node the workers reduce through shared memory as always, but with
// unnormalised weights (n_i, or 1 for equal weighting), so this node's result
// holds sum_i n_i * g_i. The node parents then allreduce, in this order, every
// step and on every node alike:
//   1. the status line: failed and non-finite counts, the weight total D, the
//      weighted loss, the samples and one has-grad count per parameter; if any
//      node failed, every node refuses the step (nothing is applied anywhere);
//   2. the result, in runs of parameters of one dtype (parameters this node's
//      workers gave no gradient are zero there already);
//   3. with BufferSync::kFromRank0, the buffers of node 0's worker 0 (the other
//      nodes send zeros) into slot 0's buffer area, where the parent takes
//      worker 0's buffers from as on one node.
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
#include "core/stage.h"
#include "multinode/node_group.h"

namespace gradagg::detail {

class CrossNode final : public ReductionStage {
 public:
  // Rendezvous, then: the same model layout on every node (else InvalidArgument
  // on every node), worker counts exchanged, parameters and buffers broadcast
  // from node 0 into this node's snapshot.
  CrossNode(const NodeOptions& options, BufferSync buffers, ModelBinding& binding,
            const SegmentMap& segment, int workers);

  Placement placement() const override;
  void beforeStep(std::int64_t step) override;  // the checksum, every checksum_interval steps
  StepTotals reduce(const StepTotals& local, std::vector<std::uint8_t>& any_grad,
                    int result) override;

 private:
  StepTotals exchangeStatus(const StepTotals& local, std::vector<std::uint8_t>& any_grad);
  void reduceResult(int result, const std::vector<std::uint8_t>& any_grad, double total);
  void gatherBuffers();
  // The nodes' parameter checksums must agree (NodeFailed otherwise).
  void checkParameters(std::int64_t step);

  NodeGroup group_;
  ModelBinding& binding_;
  SegmentMap segment_;
  int checksum_interval_ = 0;
  bool gather_buffers_ = false;
  int worker_offset_ = 0;
  int global_workers_ = 0;
  struct Span {
    std::uint64_t offset = 0;  // bytes, in the flat gradient
    at::Tensor view[2];        // over each result region
  };
  std::vector<Span> spans_;                // runs of one dtype covering every parameter
  at::Tensor status_;                      // float64 [5 + parameters]
  std::vector<at::Tensor> slot0_buffers_;  // views of slot 0's buffer area
};

}  // namespace gradagg::detail
