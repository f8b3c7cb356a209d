#include "aggregator/apply.h"

#include <algorithm>
#include <cstring>
#include <iterator>

#include <ATen/ATen.h>

namespace gradagg::detail {

namespace {
// The floating dtypes the reduction sums: the parameters' ones.
bool isReducible(c10::ScalarType t) {
  return std::find(std::begin(kParameterDtypes), std::end(kParameterDtypes), t) !=
         std::end(kParameterDtypes);
}
}  // namespace

Applier::Applier(ModelBinding& binding, const SegmentMap& segment, const Options& options)
    : binding_(binding), segment_(segment), options_(options), workers_(options.workers) {
  for (const TensorEntry& p : binding.params())
    for (int i = 0; i < 2; ++i) result_views_[i].push_back(viewAt(p, segment.result(i)));
  any_grad_.resize(binding.params().size());
  weights_.resize(static_cast<std::size_t>(workers_));
  inputs_.resize(static_cast<std::size_t>(workers_));
}

LocalOutcome Applier::collect() {
  LocalOutcome out;
  for (int r = workers_ - 1; r >= 0; --r) {
    const auto status = static_cast<SlotStatus>(segment_.control(r).status);
    if (status == SlotStatus::kFailed) out.failed = r;
    if (status == SlotStatus::kNonFinite) out.non_finite = r;
  }
  StepTotals& t = out.totals;
  t.failed = out.failed >= 0;
  t.non_finite = out.non_finite >= 0;
  t.weight_total = segment_.header().weight_total;
  for (int r = 0; r < workers_; ++r) {
    const WorkerControl& c = segment_.control(r);
    weights_[r] = c.weight;
    t.loss += c.weight * c.loss;
    t.samples += c.samples;
  }
  for (std::size_t k = 0; k < any_grad_.size(); ++k) {
    bool any = false;
    for (int r = 0; r < workers_ && !any; ++r) any = segment_.slotFlags(r)[k] != 0;
    any_grad_[k] = any ? 1 : 0;
  }
  return out;
}

void Applier::gradients(int result) {
  auto& params = binding_.params();
  for (std::size_t k = 0; k < params.size(); ++k) {
    TensorEntry& p = params[k];
    if (any_grad_[k])
      p.tensor.mutable_grad() = result_views_[result][k];
    else if (p.tensor.grad().defined())
      p.tensor.mutable_grad() = at::Tensor();
  }
}

void Applier::clearGradients() {
  for (TensorEntry& p : binding_.params())
    if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
}

void Applier::buffers() {
  if (options_.buffers == BufferSync::kKeepParent) return;
  std::byte* master = binding_.bufferRegion();
  for (TensorEntry& b : binding_.buffers()) {
    if (options_.buffers == BufferSync::kMean && isReducible(b.dtype)) {
      for (int r = 0; r < workers_; ++r) inputs_[r] = segment_.slotBuffers(r) + b.offset;
      weightedSum(elementTypeOf(b.dtype), master + b.offset, inputs_.data(), weights_.data(),
                  workers_, static_cast<std::size_t>(b.tensor.numel()));
    } else {
      std::memcpy(master + b.offset, segment_.slotBuffers(0) + b.offset, b.bytes);
    }
  }
}

void Applier::report(StepReport& report, std::int64_t step, const StepTotals& totals,
                     const StepTimes& times) const {
  using Ms = std::chrono::duration<double, std::milli>;
  const auto end = Clock::now();
  report.step = step;
  report.loss = totals.loss;
  report.samples = totals.samples;
  report.reduce_ms = 0;
  for (int r = 0; r < workers_; ++r) {
    const WorkerControl& c = segment_.control(r);
    report.workers[r] =
        WorkerReport{c.loss,        c.samples,  c.wake_ms,    c.load_ms,  c.shard_ms,
                     c.backward_ms, c.write_ms, c.barrier_ms, c.reduce_ms};
    report.reduce_ms = std::max(report.reduce_ms, c.reduce_ms);
  }
  report.publish_ms = Ms(times.command - times.begin).count();
  report.compute_ms = Ms(times.reduced - times.command).count();
  report.apply_ms = Ms(end - times.reduced).count();
  report.total_ms = Ms(end - times.begin).count();
  report.node_ms = times.node_ms;
  report.node_bytes = totals.wire_bytes;
  report.node_collectives = totals.collectives;
  report.node_overlapped = totals.overlapped;
}

}  // namespace gradagg::detail
