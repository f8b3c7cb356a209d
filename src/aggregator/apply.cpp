#include "aggregator/apply.h"

#include <algorithm>
#include <cstring>
#include <iterator>

#include <ATen/ATen.h>

#include "step/flat.h"

namespace gradagg::detail {

namespace {
// The floating dtypes the reduction sums: the parameters' ones.
bool isReducible(c10::ScalarType t) {
  return std::find(std::begin(kParameterDtypes), std::end(kParameterDtypes), t) !=
         std::end(kParameterDtypes);
}
}  // namespace

Applier::Applier(ModelBinding& binding, const SegmentMap& segment, const Options& options)
    : binding_(binding),
      segment_(segment),
      options_(options),
      workers_(options.workers),
      slots_(segment),
      row_map_(rowMap(binding.params())) {
  for (const TensorEntry& p : binding.params())
    for (int i = 0; i < 2; ++i) result_views_[i].push_back(viewAt(p, segment.result(i)));
  weights_.resize(static_cast<std::size_t>(workers_));
  inputs_.resize(static_cast<std::size_t>(workers_));
}

void Applier::gradients(int result, const std::vector<std::uint8_t>& any_grad) {
  auto& params = binding_.params();
  for (std::size_t k = 0; k < params.size(); ++k) {
    TensorEntry& p = params[k];
    if (sparseOnly(any_grad[k])) {
      touched_.resize(static_cast<std::size_t>(row_map_.rows[k]));
      slots_.touchedRows(row_map_.offset[k], row_map_.rows[k], touched_.data());
      p.tensor.mutable_grad() = sparseGradient(result_views_[result][k], touched_.data());
    } else if (any_grad[k]) {
      p.tensor.mutable_grad() = result_views_[result][k];
    } else if (p.tensor.grad().defined()) {
      p.tensor.mutable_grad() = at::Tensor();
    }
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
      for (int r = 0; r < workers_; ++r) {
        inputs_[r] = segment_.slotBuffers(r) + b.offset;
        weights_[r] = segment_.weights()[r].weight;
      }
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
    slots_.report(r, report.workers[r]);
    report.reduce_ms = std::max(report.reduce_ms, report.workers[r].reduce_ms);
  }
  report.publish_ms = Ms(times.command - times.begin).count();
  report.compute_ms = Ms(times.reduced - times.command).count();
  report.apply_ms = Ms(end - times.reduced).count();
  report.total_ms = Ms(end - times.begin).count();
  report.node_ms = times.stage_ms;
  report.node_bytes = totals.wire_bytes;
  report.node_collectives = totals.collectives;
  report.node_overlapped = totals.overlapped;
}

}  // namespace gradagg::detail
