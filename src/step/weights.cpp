#include "step/weights.h"

namespace gradagg::detail {

double WeightRule::apply(const SlotCounts* counts, int n, SlotWeight* out) const {
  double d = 0;
  for (int i = 0; i < n; ++i)
    if (counts[i].samples > 0) d += equal ? 1.0 : static_cast<double>(counts[i].samples);
  const double divisor = divided_later || d == 0 ? 1.0 : d;
  for (int i = 0; i < n; ++i) {
    const SlotCounts& c = counts[i];
    if (c.samples <= 0) {
      out[i] = SlotWeight{0, 0};
      continue;
    }
    const double w = (equal ? 1.0 : static_cast<double>(c.samples)) / divisor;
    double factor = w;
    if (micro_steps > 1) factor = equal ? w / c.micro : w / static_cast<double>(c.samples);
    out[i] = SlotWeight{w, factor};
  }
  return d;
}

}  // namespace gradagg::detail
