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
//     global D; with BufferSync::kFromRank0 the buffers of node 0's worker 0
//     (the other nodes send zeros) are allreduced into slot 0's buffer area,
//     where the parent takes worker 0's buffers from as on one node.
// Gloo's ring gives every node the same bits, so every node takes the same
// optimizer step.
//
// A model bigger than NodeOptions::bucket_bytes per dtype crosses in buckets
// (core/buckets.h), the status alone after them. With overlap the parent sums
// each early bucket over this node's slots as soon as its workers produced it
// and hands it to sendEarly(): a thread of this stage allreduces the early
// buckets in order while backward goes on; reduce() waits for them, then sends
// the last bucket and the status. Every node sends the same pieces in the same
// order whether they went early or not, so overlap changes when, not what:
// the same bits either way. With Compression::kBFloat16 float32 runs travel as bf16
// (each addition in float32, rounded to bf16) and the status in a second,
// small collective, so it stays exact. Counts travel as two exact parts (hi * 4096 + lo), so a
// float32 status stays exact up to 2^36.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <gradagg/options.h>

#include "core/buckets.h"
#include "core/layout.h"
#include "core/model_binding.h"
#include "core/stage.h"
#include "multinode/node_group.h"

namespace gradagg::detail {

class CrossNode final : public ReductionStage {
 public:
  // Rendezvous, then: the same model layout and the same start-up agreement
  // (NodeOptions::start_step, resume_identity, must_match) on every node (else
  // InvalidArgument on every node), worker counts exchanged, parameters and
  // buffers broadcast from node 0 into this node's snapshot; all of it within
  // options.timeout (else NodeFailed).
  CrossNode(const NodeOptions& options, BufferSync buffers, ModelBinding& binding,
            const SegmentMap& segment, int workers, const BucketPlan& plan);
  ~CrossNode() override;

  Placement placement() const override { return placement_; }
  void beforeStep(std::int64_t step) override;  // the checksum, every checksum_interval steps
  StepTotals reduce(const StepTotals& local, std::vector<std::uint8_t>& any_grad,
                    int result) override;
  void sendEarly(int bucket, int result, bool overlapped) override;
  int earlySent() const override;

 private:
  // What crosses: a byte range of both result regions in one dtype, bound once.
  struct Piece {
    at::Tensor view[2];
    at::Tensor wire;            // Compression::kBFloat16 on float32: the bf16 buffer that travels
    std::vector<int> sum[2];    // the bound sum, per result region
  };
  void send(Piece& piece, int result);
  void sendLoop();
  // Waits until the early buckets queued this step are sent; returns how many
  // (and starts the count afresh). Rethrows the sender's NodeFailed.
  int awaitSent();

  // Status tail -> buffer -> status, in the dtype of the last run.
  template <typename T>
  void writeStatus(T* s, const StepTotals& local, const std::vector<std::uint8_t>& any_grad) const;
  template <typename T>
  StepTotals readStatus(const T* s, std::vector<std::uint8_t>& any_grad) const;
  void divide(int result, const std::vector<std::uint8_t>& any_grad, double total);
  void gatherBuffers();
  // The nodes' parameter checksums must agree (NodeFailed otherwise).
  void checkParameters(std::int64_t step);

  NodeGroup group_;
  ModelBinding& binding_;
  SegmentMap segment_;
  int checksum_interval_ = 0;
  bool gather_buffers_ = false;
  Placement placement_;  // found at the rendezvous
  // In crossing order; the last one carries the status tail.
  std::vector<Piece> pieces_;
  std::uint64_t wire_bytes_ = 0;  // per step, from this node
  int early_ = 0;
  // The sender thread and what it shares with the parent's thread.
  std::thread sender_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::pair<int, int>> queue_;  // (bucket, result region)
  int queued_ = 0, done_ = 0;              // this step
  int overlapped_ = 0;                     // this step
  std::exception_ptr error_;
  bool stopping_ = false;
  c10::ScalarType status_dtype_ = c10::ScalarType::Double;
  std::vector<at::Tensor> slot0_buffers_;  // views of slot 0's buffer area
};

}  // namespace gradagg::detail
