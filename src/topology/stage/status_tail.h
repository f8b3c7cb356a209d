// The status tail: a step's status as it crosses the nodes, in the stage tail
// after the result (step/layout.h), right after the last dtype run and in its
// dtype, so that one allreduce sums gradient and status together. Every field
// is a sum over the nodes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/segment.h"
#include "step/slots.h"

namespace gradagg::detail {

template <typename T>
struct StatusFields {
  T failed;           // nodes whose workers failed
  T non_finite;       // nodes that found a NaN or infinity
  T weight_total[2];  // D, as a count (putCount)
  T samples[2];       // the samples, as a count
  T loss;             // sum_i n_i loss_i (the workers' weights are n_i across nodes)
  T metrics;          // per node: its metric names' count * kMetricNodes, + 1 when it has
                      // any (a node whose workers had no samples has none); the values
                      // cross in a collective of their own, in double
  // Then one has-grad count per parameter: the nodes where some worker gave
  // it a dense gradient, plus kSparseNodes times those where one gave it a
  // sparse gradient (step/sparse_rows.h).
};
inline constexpr std::uint64_t kStatusFields = 8;
// Exact in float32 for up to kMetricNodes - 1 nodes of ShardResult::kMaxMetrics names.
inline constexpr int kMetricNodes = 1024;
// Exact in float32 (< 2^24) for up to kSparseNodes - 1 nodes.
inline constexpr std::int64_t kSparseNodes = 4096;
static_assert(sizeof(StatusFields<float>) == kStatusFields * sizeof(float) &&
              sizeof(StatusFields<double>) == kStatusFields * sizeof(double));

// The stage tail for `param_count` parameters: the fields and the counts, in
// the widest dtype.
constexpr std::uint64_t statusBytes(std::uint64_t param_count) {
  return alignUp(8 * (kStatusFields + param_count), kAlign);
}

namespace status_detail {
// A count as two parts that each stay exact in float32 (< 2^24) when summed:
// exact up to 2^36.
constexpr std::int64_t kLow = 4096;
template <typename T>
void putCount(T* s, std::int64_t v) {
  s[0] = static_cast<T>(v / kLow);  // NOLINT(bugprone-integer-division): the high part, exact
  s[1] = static_cast<T>(v % kLow);
}
template <typename T>
std::int64_t getCount(const T* s) {
  return static_cast<std::int64_t>(s[0]) * kLow + static_cast<std::int64_t>(s[1]);
}
}  // namespace status_detail

template <typename T>
void writeStatus(std::byte* tail, const StepTotals& local,
                 const std::vector<std::uint8_t>& any_grad) {
  auto* s = reinterpret_cast<StatusFields<T>*>(tail);
  s->failed = local.failed ? 1 : 0;
  s->non_finite = local.non_finite ? 1 : 0;
  status_detail::putCount(s->weight_total, static_cast<std::int64_t>(local.weight_total));
  status_detail::putCount(s->samples, local.samples);
  s->loss = static_cast<T>(local.loss);
  s->metrics = static_cast<T>(local.metric_count * kMetricNodes + (local.metric_count > 0));
  T* has_grad = reinterpret_cast<T*>(tail) + kStatusFields;
  for (std::size_t k = 0; k < any_grad.size(); ++k)
    has_grad[k] = static_cast<T>(((any_grad[k] & kDenseGrad) ? 1 : 0) +
                                 ((any_grad[k] & kSparseGrad) ? kSparseNodes : 0));
}

template <typename T>
StepTotals readStatus(const std::byte* tail, std::vector<std::uint8_t>& any_grad) {
  const auto* s = reinterpret_cast<const StatusFields<T>*>(tail);
  StepTotals out;
  out.failed = s->failed > 0;
  out.non_finite = s->non_finite > 0;
  out.weight_total = static_cast<double>(status_detail::getCount(s->weight_total));
  out.samples = status_detail::getCount(s->samples);
  out.loss = out.weight_total > 0 ? static_cast<double>(s->loss) / out.weight_total : 0;
  out.metric_count = static_cast<int>(s->metrics);  // the sum, as encoded: CrossNode reads it
  const T* has_grad = reinterpret_cast<const T*>(tail) + kStatusFields;
  for (std::size_t k = 0; k < any_grad.size(); ++k) {
    const auto nodes = static_cast<std::int64_t>(has_grad[k]);
    any_grad[k] = static_cast<std::uint8_t>((nodes % kSparseNodes > 0 ? kDenseGrad : 0) |
                                            (nodes / kSparseNodes > 0 ? kSparseGrad : 0));
  }
  return out;
}

}  // namespace gradagg::detail
