// The weighting rule of a step, written once.
//
// Worker i reports n_i samples. Its weight is w_i = n_i / D with D = sum_j n_j,
// or, with equal weighting, w_i = 1 / N with D = N: the step's mean gradient is
// sum_i w_i g_i, its loss sum_i w_i loss_i, and the mean buffers the same. When
// a later stage combines these sums with other groups' (ReductionStage::
// dividesLater), w_i is n_i (or 1) and that stage divides by the combined D.
//
// A slot holds g_i, or, accumulating k micro-batches, sum_j n_j g_j (by
// samples) or sum_j g_j (equal): its factor, what the reduction multiplies the
// slot by, is w_i, or w_i / n_i, or w_i / k.
#pragma once

#include <cstdint>

#include "step/layout.h"

namespace gradagg::detail {

struct WeightRule {
  bool equal = false;         // Weighting::kEqual
  int micro_steps = 1;        // Options::accumulation_steps
  bool divided_later = false; // w_i unnormalised: a later stage divides by D

  // D for these samples.
  double total(const std::int64_t* samples, int n) const;
  // Every slot's weight and factor for these samples; returns D.
  double apply(const std::int64_t* samples, int n, SlotWeight* out) const;
};

}  // namespace gradagg::detail
