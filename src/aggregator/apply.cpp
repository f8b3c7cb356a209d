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

void Applier::gradients(const Reduced& step) {
  auto& params = binding_.params();
  const std::vector<at::Tensor>& views = result_views_[step.result];
  for (std::size_t k = 0; k < params.size(); ++k) {
    TensorEntry& p = params[k];
    if (sparseOnly(step.has_grad[k])) {
      p.tensor.mutable_grad() = sparseGradient(views[k], step.rows.data() + row_map_.offset[k]);
    } else if (step.has_grad[k]) {
      p.tensor.mutable_grad() = views[k];
    } else if (p.tensor.grad().defined()) {
      p.tensor.mutable_grad() = at::Tensor();
    }
  }
}

void Applier::clearGradients() {
  for (TensorEntry& p : binding_.params())
    if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
}

void Applier::buffers(const std::byte* first) {
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
      std::memcpy(master + b.offset, first + b.offset, b.bytes);
    }
  }
}

void Applier::report(StepReport& report, std::int64_t step, const Reduced& totals,
                     const StepTimes& times) const {
  using Ms = std::chrono::duration<double, std::milli>;
  const auto end = Clock::now();
  report.step = step;
  report.loss = totals.sums.loss;
  report.samples = totals.sums.samples;
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
  report.node_bytes = totals.wire.bytes;
  report.node_collectives = totals.wire.collectives;
  report.node_overlapped = totals.wire.overlapped;
}

}  // namespace gradagg::detail
