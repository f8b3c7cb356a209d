// The status tail: a step's status as it crosses the nodes, in the stage tail
// after the result (step/layout.h), right after the last dtype run and in its
// dtype, so that one allreduce sums gradient and status together. Every field
// is a sum over the nodes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/segment.h"
#include "step/outcome.h"
#include "step/sparse_rows.h"

namespace gradagg::detail {

template <typename T>
struct StatusFields {
  T failed;           // nodes whose workers failed
  T non_finite;       // nodes that found a NaN or infinity
  T weight_total[2];  // D, as a count (putCount)
  T samples[2];       // the samples, as a count
  T loss;             // sum_i n_i loss_i (the workers' weights are n_i across nodes)
  T metric_nodes;     // nodes whose workers returned metrics (a node whose workers
                      // never had samples has none)
  T metric_names;     // the metric names' counts of those nodes; the values cross in a
                      // collective of their own, in double (CrossNode::sumMetrics)
  // Then one has-grad count per parameter: the nodes where some worker gave
  // it a dense gradient, plus kSparseNodes times those where one gave it a
  // sparse gradient (step/sparse_rows.h).
};
inline constexpr std::uint64_t kStatusFields = 9;
// Exact in float32 (< 2^24) for up to kSparseNodes - 1 nodes.
inline constexpr std::int64_t kSparseNodes = 4096;
static_assert(sizeof(StatusFields<float>) == kStatusFields * sizeof(float) &&
              sizeof(StatusFields<double>) == kStatusFields * sizeof(double));

// The status summed over the nodes, as read back.
struct NodeStatus {
  bool failed = false;      // some node failed (or gave up on the step)
  bool non_finite = false;  // some node found a NaN or infinity
  StepSums sums;            // the metrics aside; loss is the mean loss
  int metric_nodes = 0;
  int metric_names = 0;  // summed over the metric_nodes
};

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

// This node's status; the has-grad counts of parameters past
// local.has_grad's end (a contribution without flags) are 0.
template <typename T>
void writeStatus(std::byte* tail, const Contribution& local, std::size_t param_count) {
  auto* s = reinterpret_cast<StatusFields<T>*>(tail);
  s->failed = local.failed() ? 1 : 0;
  s->non_finite = local.nonFinite() ? 1 : 0;
  status_detail::putCount(s->weight_total, static_cast<std::int64_t>(local.sums.weight_total));
  status_detail::putCount(s->samples, local.sums.samples);
  s->loss = static_cast<T>(local.sums.loss);
  s->metric_nodes = local.sums.metrics.count > 0 ? 1 : 0;
  s->metric_names = static_cast<T>(local.sums.metrics.count);
  T* has_grad = reinterpret_cast<T*>(tail) + kStatusFields;
  for (std::size_t k = 0; k < param_count; ++k) {
    const std::uint8_t flags = k < local.has_grad.size() ? local.has_grad[k] : 0;
    has_grad[k] =
        static_cast<T>(((flags & kDenseGrad) ? 1 : 0) + ((flags & kSparseGrad) ? kSparseNodes : 0));
  }
}

// The status summed over the nodes; every node's has-grad flags OR-ed into
// `has_grad` (param_count of them).
template <typename T>
NodeStatus readStatus(const std::byte* tail, std::uint8_t* has_grad_out, std::size_t param_count) {
  const auto* s = reinterpret_cast<const StatusFields<T>*>(tail);
  NodeStatus out;
  out.failed = s->failed > 0;
  out.non_finite = s->non_finite > 0;
  out.sums.weight_total = static_cast<double>(status_detail::getCount(s->weight_total));
  out.sums.samples = status_detail::getCount(s->samples);
  out.sums.loss =
      out.sums.weight_total > 0 ? static_cast<double>(s->loss) / out.sums.weight_total : 0;
  out.metric_nodes = static_cast<int>(s->metric_nodes);
  out.metric_names = static_cast<int>(s->metric_names);
  const T* has_grad = reinterpret_cast<const T*>(tail) + kStatusFields;
  for (std::size_t k = 0; k < param_count; ++k) {
    const auto nodes = static_cast<std::int64_t>(has_grad[k]);
    has_grad_out[k] = static_cast<std::uint8_t>((nodes % kSparseNodes > 0 ? kDenseGrad : 0) |
                                                (nodes / kSparseNodes > 0 ? kSparseGrad : 0));
  }
  return out;
}

}  // namespace gradagg::detail
