// CrossNode: the reduction's second stage when a run spans several machines.
//
// Inside a node the workers reduce through shared memory as always, but with
// unnormalised weights (n_i, or 1 for equal weighting), so this node's result
// holds sum_i n_i * g_i. Then, every step and on every node alike, the parent
// writes the step's status into the result's status tail (failed and
// non-finite counts, the weight total D, the samples, the weighted loss, one
// has-grad count per parameter) and the node parents allreduce the result: one
// collective per dtype run (float32 and float64 are one run each), the status
// riding at the end of the last, run by gloo in this thread. One round trip
// carries both, so a small model pays Gloo's latency once per step. After it:
//   - if any node failed (or found a non-finite gradient), every node refuses
//     the step and discards the sums (nothing is applied anywhere);
//   - else each node divides every parameter some node gave a gradient by the
//     global D; with BufferSync::kFromRank0 the parent then hands the stage
//     its worker 0's buffers (firstBuffers) and the node parents allreduce a
//     copy, the other nodes sending zeros: node 0's worker 0's.
// Gloo's ring gives every node the same bits, so every node takes the same
// optimizer step.
//
// A model bigger than NodeOptions::bucket_bytes per dtype crosses in buckets
// (step/buckets.h), the status alone after them. With overlap the parent sums
// each early bucket over this node's slots as soon as its workers produced it
// and hands it to sendEarly(): a thread of this stage allreduces the early
// buckets in order while backward goes on; reduce() waits for them, then sends
// the last bucket and the status. Every node sends the same pieces in the same
// order whether they went early or not, so overlap changes when, not what:
// the same bits either way. With Compression::kBFloat16 float32 runs travel as bf16
// (each addition in float32, rounded to bf16) and the status in a second,
// small collective, so it stays exact. Counts travel as two exact parts (hi * 4096 + lo), so a
// float32 status stays exact up to 2^36 (topology/stage/status_tail.h).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <gradagg/options.h>

#include "model/model_binding.h"
#include "step/buckets.h"
#include "step/layout.h"
#include "step/sparse_rows.h"
#include "step/stage.h"
#include "topology/group/node_group.h"
#include "topology/stage/placement.h"

namespace gradagg::detail {

class CrossNode final : public ReductionStage {
 public:
  // The rendezvous (topology/stage/rendezvous.h): the same model and the same
  // start-up agreement on every node (else InvalidArgument on every node),
  // worker counts exchanged; within options.nodes.timeout (else NodeFailed).
  CrossNode(const Options& options, ModelBinding& binding);
  ~CrossNode() override;

  const Placement& placement() const { return placement_; }

  std::uint64_t tailBytes() const override;
  bool dividesLater() const override { return true; }
  const BucketPlan& buckets() const override { return plan_; }
  // Node 0's parameters and buffers into this node's snapshot, the pieces
  // bound to the results; ends the rendezvous.
  void attach(const SegmentMap& segment) override;
  void beforeStep(std::int64_t step) override;  // the checksum, every checksum_interval steps
  Reduced reduce(const Contribution& local, int result) override;
  const std::byte* firstBuffers(const std::byte* local) override;
  void sendEarly(int bucket, int result, bool overlapped) override;
  int earlySent() const override;

 private:
  // What crosses: a byte range of both result regions in one dtype, bound once.
  struct Piece {
    at::Tensor view[2];
    at::Tensor wire;          // Compression::kBFloat16 on float32: the bf16 buffer that travels
    std::vector<int> sum[2];  // the bound sum, per result region
  };
  Piece bindPiece(ByteRange range, c10::ScalarType dtype, bool status);
  void send(Piece& piece, int result);
  void sendLoop();
  // Waits until the early buckets queued this step are sent; returns how many
  // (and starts the count afresh). Rethrows the sender's NodeFailed.
  int awaitSent();
  // The metrics' sums over the nodes (a collective of their own), given how
  // many nodes returned metrics and their name counts' sum (the status).
  MetricSums sumMetrics(const MetricSums& local, int nodes, int names);
  // For parameters whose gradients were sparse everywhere (`has_grad`,
  // everyone's): the rows touched on any node, as Reduced::rows (a collective
  // of its own, only then); empty when there are none.
  c10::ArrayRef<std::uint8_t> unionRows(c10::ArrayRef<std::uint8_t> local,
                                        c10::ArrayRef<std::uint8_t> has_grad);
  void divide(int result, c10::ArrayRef<std::uint8_t> has_grad, double total);
  // The nodes' parameter checksums must agree (NodeFailed otherwise).
  void checkParameters(std::int64_t step);

  NodeGroup group_;
  ModelBinding& binding_;
  BucketPlan plan_;
  Compression compression_;
  int checksum_interval_ = 0;
  bool gather_buffers_ = false;
  Placement placement_;  // found at the rendezvous
  SegmentMap segment_;   // from attach()
  // In crossing order; the last one carries the status tail.
  std::vector<Piece> pieces_;
  std::uint64_t wire_bytes_ = 0;  // per step, from this node
  c10::ScalarType status_dtype_ = c10::ScalarType::Double;
  at::Tensor first_buffers_;                    // firstBuffers(): node 0's first buffers
  std::vector<at::Tensor> first_buffer_views_;  // per buffer, into first_buffers_
  RowMap row_map_;
  std::vector<std::uint8_t> all_has_grad_, all_rows_;  // reduce()'s Reduced views these
  at::Tensor metrics_;  // ShardResult::kMaxMetrics doubles, the metric sums that cross, and the
                        // sum of the nodes' squared name counts (sumMetrics)
  // The sender thread and what it shares with the parent's thread.
  std::thread sender_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::pair<int, int>> queue_;  // (bucket, result region)
  int queued_ = 0, done_ = 0;              // this step
  int overlapped_ = 0;                     // this step
  std::exception_ptr error_;
  bool stopping_ = false;
};

}  // namespace gradagg::detail
