// The reduction's second stage: what happens to a step after this node's
// workers summed their slots into the result. On one node it is nothing (the
// LocalStage below); across nodes (src/multinode) the node parents combine
// their totals and results with one another. The parent's step calls it the
// same way whatever the topology, as c10d's Reducer is blind to it.
#pragma once

#include <cstdint>
#include <vector>

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
  // The workers divide by the weight total themselves (one node), or leave
  // sum_i n_i g_i for the stage to divide after combining (several).
  bool normalize = true;
};

// Whether a node's parent has a core that none of the processes on these cores
// needs while it waits: every worker's threads and every node parent fit the
// cores (ParentChannel::setOwnCore: then its waits spin instead of sleeping).
inline bool parentHasOwnCore(const Placement& p, int threads_per_worker, int cores) {
  return p.host_workers * threads_per_worker + p.host_nodes <= cores;
}

// A step's outcome: this node's after its workers reduced; everyone's after
// the stage.
struct StepTotals {
  bool failed = false;      // a worker failed (after the stage: on some node)
  bool non_finite = false;  // a gradient or loss was NaN or infinite (idem)
  double weight_total = 0;  // D: the samples, or one per worker with equal weighting
  // sum_i w_i loss_i with the step's weights: the weighted mean loss on one
  // node (normalised weights) and after the stage; sum_i n_i loss_i before it
  // across nodes.
  double loss = 0;
  std::int64_t samples = 0;
  // After the stage: the bytes this node contributed to the step's collectives
  // (0 on one node).
  std::uint64_t wire_bytes = 0;
  int collectives = 0;  // after the stage: how many carried the step
  int overlapped = 0;   // of them, started while the workers computed
};

class ReductionStage {
 public:
  virtual ~ReductionStage() = default;
  virtual Placement placement() const = 0;
  // Before step `step` is commanded (across nodes: the periodic parameter
  // checksum). Throws NodeFailed.
  virtual void beforeStep(std::int64_t step) = 0;
  // After this node's workers reduced into result region `result`. Combines the
  // totals; when no node failed, also the result (left as the mean gradient)
  // and `any_grad` (per parameter: in, this node's flags; out, every node's).
  // Throws NodeFailed.
  virtual StepTotals reduce(const StepTotals& local, std::vector<std::uint8_t>& any_grad,
                            int result) = 0;
  // Early buckets (core/buckets.h): this node's sum of early bucket `bucket` is
  // in result region `result`; start its combination with the other nodes (in
  // the background: reduce() waits for it and reports its failure).
  // `overlapped`: the workers were still computing when it went.
  virtual void sendEarly(int /*bucket*/, int /*result*/, bool /*overlapped*/) {}
  // How many early buckets of the current step were sent (reduce() resets it).
  virtual int earlySent() const { return 0; }
};

// One node: the workers' result is already the mean; nothing to combine.
class LocalStage final : public ReductionStage {
 public:
  explicit LocalStage(int workers) {
    placement_.global_workers = workers;
    placement_.host_workers = workers;
  }
  Placement placement() const override { return placement_; }
  void beforeStep(std::int64_t) override {}
  StepTotals reduce(const StepTotals& local, std::vector<std::uint8_t>&, int) override {
    return local;
  }

 private:
  Placement placement_;
};

}  // namespace gradagg::detail
