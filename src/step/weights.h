// The weighting rule of a step, written once.
//
// Worker i reports n_i samples from c_i micro-batches that had samples. The
// contributors are the workers with n_i > 0; a worker with none (the end of an
// uneven epoch) has weight 0. A contributor's weight is w_i = n_i / D with
// D = sum_j n_j, or, with equal weighting, w_i = 1 / C with D = C, the number
// of contributors: the step's mean gradient is sum_i w_i g_i, its loss
// sum_i w_i loss_i, and the mean buffers the same. When a later stage
// combines these sums with other groups' (ReductionStage::dividesLater), w_i
// is n_i (or 1) and that stage divides by the combined D. D = 0 (nobody had a
// sample) leaves every weight 0; the step is then refused.
//
// A slot holds g_i, or, accumulating micro-batches, sum_j n_j g_j (by
// samples) or sum_j g_j (equal): its factor, what the reduction multiplies the
// slot by, is w_i, or w_i / n_i, or w_i / c_i.
#pragma once

#include <cstdint>

#include "step/layout.h"

namespace gradagg::detail {

// What one slot holds, as the rule needs it.
struct SlotCounts {
  std::int64_t samples = 0;  // n_i
  std::int32_t micro = 0;    // c_i: micro-batches with samples
};

struct WeightRule {
  bool equal = false;          // Weighting::kEqual
  int micro_steps = 1;         // Options::accumulation_steps
  bool divided_later = false;  // w_i unnormalised: a later stage divides by D

  // Every slot's weight and factor for these counts; returns D.
  double apply(const SlotCounts* counts, int n, SlotWeight* out) const;
};

}  // namespace gradagg::detail
