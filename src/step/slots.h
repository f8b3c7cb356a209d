// A worker's slot and control block, and the only two classes that touch them:
// the worker writes its own through a SlotWriter, the parent reads them all
// through a SlotReader (step/layout.h says what lies where and when).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <gradagg/errors.h>
#include <gradagg/step_report.h>

#include "model/model_binding.h"
#include "step/flat.h"
#include "step/layout.h"
#include "step/outcome.h"
#include "step/sparse_rows.h"
#include "step/weights.h"

namespace gradagg::detail {

// What a worker's step came to, written into its control block.
struct SlotSummary {
  SlotCounts counts;  // samples and micro-batches with samples
  double loss = 0;    // 0 when it had no samples
  const std::map<std::string, double>* metrics = nullptr;
};

// Worker `rank`'s side: its gradient area (where .grad points), its has-grad
// flags, its buffers and its WorkerControl.
class SlotWriter {
 public:
  SlotWriter(const SegmentMap& map, int rank);

  // Once, at set-up: every trainable parameter's .grad becomes a view of this
  // slot, and a hook on it flags that it received a gradient (and counts it:
  // gradientsSeen(), so a shard function that runs backward itself is told).
  void bind(ModelBinding& binding);
  std::uint64_t gradientsSeen() const { return gradients_seen_; }
  // Whether a flagged parameter's gradient area holds anything but zeros: after
  // begin(), backward ran into the slot (torch.autograd.grad fires the hooks
  // too, but writes nothing there). Scans; for the rare path only.
  bool anyGradientWritten() const;
  // Each step, before the shard function: status ok, no message, phase times
  // zero, the gradient area and flags zeroed, any .grad the shard function
  // moved last step pointed back at the slot.
  void begin();
  // Parameter k's view in the slot.
  const at::Tensor& gradView(std::size_t k) const { return grad_views_[k]; }
  // With early buckets: the counts, before the first bucket line is taken.
  void setCounts(const SlotCounts& counts) {
    control_.samples = counts.samples;
    control_.micro_count = counts.micro;
  }
  // After backward: checks that no parameter was replaced, copies a gradient
  // the shard function moved elsewhere, writes the buffers, counts, loss and
  // metrics. Throws InvalidArgument or NonFiniteGradient (naming the parameter).
  void write(const SlotSummary& summary);
  // The exception being handled becomes this step's failure: kNonFinite for a
  // NonFiniteGradient, otherwise kFailed, with its message and the phase.
  void failed() noexcept;

  PhaseTimes& times() { return control_.times; }
  void setPid(std::int32_t pid) { control_.pid = pid; }

 private:
  void checkFinite();
  void writeMetrics(const std::map<std::string, double>* metrics);

  SegmentMap map_;
  int rank_;
  WorkerControl& control_;
  std::byte* gradient_;
  std::uint8_t* flags_;
  std::uint8_t* rows_;
  RowMap row_map_;
  ModelBinding* binding_ = nullptr;
  std::vector<FlatTensor> flat_;
  std::vector<at::Tensor> grad_views_;
  std::uint64_t gradients_seen_ = 0;
};

// The parent's side: every worker's slot and control block, read after the
// workers arrived (or died).
class SlotReader {
 public:
  explicit SlotReader(const SegmentMap& map);

  // Before the parent forks a group: every status ok, no message.
  void prepareStart();
  // The collect phase (step/outcome.h), metrics aside: statuses, sums (with
  // the closer's weights), the has-grad flags OR-ed and, for parameters whose
  // every gradient was sparse, the rows touched OR-ed (`rows` says where);
  // the flags and rows are views of this reader's, valid until the next call.
  Contribution collect(const RowMap& rows);
  // Every worker with samples left the same gradient, bit for bit, and it is
  // not all zeros: they most likely read the same batch (a parent's iterator
  // read in the shard function). False with fewer than two such workers.
  bool identicalGradients() const;

  int workers() const { return workers_; }
  bool ok(int r) const { return status(r) == SlotStatus::kOk; }
  SlotStatus status(int r) const { return static_cast<SlotStatus>(map_.control(r).status); }
  Phase failedPhase(int r) const { return static_cast<Phase>(map_.control(r).failed_phase); }
  std::string message(int r) const;
  int badParam(int r) const { return map_.control(r).bad_param; }
  std::int64_t samples(int r) const { return map_.control(r).samples; }
  SlotCounts counts(int r) const {
    return SlotCounts{map_.control(r).samples, map_.control(r).micro_count};
  }
  // The worker's SIGSEGV handler's finding: the snapshot offset it wrote to, or -1.
  std::int64_t faultOffset(int r) const {
    return map_.control(r).fault_offset.load(std::memory_order_relaxed);
  }
  // Worker r's report, its metrics aside (step/metrics.h fills them).
  void report(int r, WorkerReport& out) const;

 private:
  SegmentMap map_;
  int workers_;
  std::vector<std::uint8_t> has_grad_, rows_;  // collect()'s, reused every step
};

}  // namespace gradagg::detail
