#include "step/reduce_scatter.h"

namespace gradagg::detail {

ReduceScatter::ReduceScatter(const SegmentMap& map, std::vector<FlatTensor> flat, WeightRule rule)
    : map_(map),
      slots_(map),
      flat_(std::move(flat)),
      rule_(rule),
      n_(map.workers()),
      counts_(static_cast<std::size_t>(n_)),
      weights_(static_cast<std::size_t>(n_)),
      factors_(static_cast<std::size_t>(n_)) {
  for (int r = 0; r < n_; ++r) gradients_.push_back(map.slot(r));
}

void ReduceScatter::close() {
  Header& h = map_.header();
  SlotWeight* weights = map_.weights();
  bool ok = true;
  for (int r = 0; r < n_; ++r) {
    ok = ok && slots_.ok(r);
    counts_[r] = slots_.counts(r);
  }
  if (ok) {
    h.weight_total = rule_.apply(counts_.data(), n_, weights);
  } else {
    for (int r = 0; r < n_; ++r) weights[r] = SlotWeight{0, 0};
    h.weight_total = 0;
  }
  h.step_ok = ok ? 1 : 0;
}

void ReduceScatter::reduce(ByteRange range) {
  const Header& h = map_.header();
  if (h.step_ok == 0) return;  // nothing is applied
  const SlotWeight* weights = map_.weights();
  for (int r = 0; r < n_; ++r) factors_[r] = weights[r].factor;
  reduceRange(flat_, range, map_.result(static_cast<int>(h.result_index)), gradients_.data(),
              factors_.data(), n_);
}

void ReduceScatter::reduceEarly(ByteRange range, int result, bool first) {
  if (first) {
    for (int r = 0; r < n_; ++r) counts_[r] = slots_.counts(r);
    rule_.apply(counts_.data(), n_, weights_.data());
    for (int r = 0; r < n_; ++r) factors_[r] = weights_[r].factor;
  }
  reduceRange(flat_, range, map_.result(result), gradients_.data(), factors_.data(), n_);
}

}  // namespace gradagg::detail
