#include "step/weights.h"

namespace gradagg::detail {

double WeightRule::total(const std::int64_t* samples, int n) const {
  double d = 0;
  for (int i = 0; i < n; ++i) d += equal ? 1.0 : static_cast<double>(samples[i]);
  return d;
}

double WeightRule::apply(const std::int64_t* samples, int n, SlotWeight* out) const {
  const double d = total(samples, n);
  const double divisor = divided_later ? 1.0 : d;
  for (int i = 0; i < n; ++i) {
    const double w = (equal ? 1.0 : static_cast<double>(samples[i])) / divisor;
    double factor = w;
    if (micro_steps > 1) factor = equal ? w / micro_steps : w / static_cast<double>(samples[i]);
    out[i] = SlotWeight{w, factor};
  }
  return d;
}

}  // namespace gradagg::detail
