#include "multinode/cross_node.h"

#include <cstring>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <gradagg/errors.h>

namespace gradagg::detail {

namespace {

std::string describeLayout(const ModelBinding& binding) {
  std::string out;
  for (const auto* list : {&binding.params(), &binding.buffers()}) {
    for (const TensorEntry& e : *list)
      out += fmt::format("{} {} {}\n", list == &binding.params() ? "parameter" : "buffer", e.name,
                         describeShape(e.sizes, e.dtype));
  }
  return out;
}

// The first line where two layout descriptions differ.
std::string firstDifference(const std::string& a, const std::string& b) {
  std::size_t pa = 0, pb = 0;
  for (;;) {
    const std::size_t ea = a.find('\n', pa), eb = b.find('\n', pb);
    const std::string la = pa < a.size() ? a.substr(pa, ea - pa) : "(nothing)";
    const std::string lb = pb < b.size() ? b.substr(pb, eb - pb) : "(nothing)";
    if (la != lb) return fmt::format("'{}' against '{}'", la, lb);
    if (ea == std::string::npos || eb == std::string::npos) return "the same lines";
    pa = ea + 1;
    pb = eb + 1;
  }
}

std::uint64_t fnv1a(const std::byte* p, std::size_t n, std::uint64_t h) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<std::uint8_t>(p[i])) * 1099511628211ull;
  return h;
}

}  // namespace

CrossNode::CrossNode(const NodeOptions& options, BufferSync buffers, ModelBinding& binding,
                     const SegmentMap& segment, int workers)
    : group_(options),
      binding_(binding),
      segment_(segment),
      checksum_interval_(options.checksum_interval),
      gather_buffers_(buffers == BufferSync::kFromRank0) {
  // The same model everywhere, checked by comparing layouts through the store.
  const std::string mine = describeLayout(binding);
  const auto all = group_.exchange("layout", mine);
  for (int r = 0; r < group_.size(); ++r) {
    if (all[r] == all[0]) continue;
    throw InvalidArgument(
        fmt::format("gradagg: node {} has a different model from node 0 (this is node {}): {}", r,
                    group_.rank(), firstDifference(all[r], all[0])));
  }
  const auto counts = group_.exchange("workers", std::to_string(workers));
  for (int r = 0; r < group_.size(); ++r) {
    const int c = std::stoi(counts[r]);
    if (r < group_.rank()) worker_offset_ += c;
    global_workers_ += c;
  }
  // The same initial values everywhere: node 0's.
  for (TensorEntry& e : binding.params()) {
    at::Tensor v = viewAt(e, binding.paramRegion());
    group_.broadcastFromNode0(v, "broadcasting the initial parameters");
  }
  for (TensorEntry& e : binding.buffers()) {
    at::Tensor v = viewAt(e, binding.bufferRegion());
    group_.broadcastFromNode0(v, "broadcasting the initial buffers");
    slot0_buffers_.push_back(viewAt(e, segment_.slotBuffers(0)));
  }
  // Runs of parameters of one dtype, each one collective.
  const auto& params = binding.params();
  for (std::size_t k = 0; k < params.size();) {
    std::size_t j = k;
    while (j + 1 < params.size() && params[j + 1].dtype == params[k].dtype) ++j;
    const std::uint64_t begin = params[k].offset;
    const std::uint64_t end = params[j].offset + params[j].bytes;
    const auto count = static_cast<std::int64_t>((end - begin) / c10::elementSize(params[k].dtype));
    Span span;
    span.offset = begin;
    for (int i = 0; i < 2; ++i)
      span.view[i] = at::from_blob(segment_.result(i) + begin, {count},
                                   at::TensorOptions().dtype(params[k].dtype));
    spans_.push_back(std::move(span));
    k = j + 1;
  }
  status_ = at::zeros({static_cast<std::int64_t>(5 + params.size())}, at::kDouble);
}

Placement CrossNode::placement() const {
  return Placement{group_.rank(), group_.size(), worker_offset_, global_workers_,
                   /*normalize=*/false};
}

void CrossNode::beforeStep(std::int64_t step) {
  if (checksum_interval_ > 0 && step > 0 && step % checksum_interval_ == 0) checkParameters(step);
}

StepTotals CrossNode::reduce(const StepTotals& local, std::vector<std::uint8_t>& any_grad,
                             int result) {
  const StepTotals all = exchangeStatus(local, any_grad);
  if (all.failed || all.non_finite) return all;
  reduceResult(result, any_grad, all.weight_total);
  if (gather_buffers_) gatherBuffers();
  return all;
}

StepTotals CrossNode::exchangeStatus(const StepTotals& local, std::vector<std::uint8_t>& any_grad) {
  double* s = status_.data_ptr<double>();
  s[0] = local.failed ? 1 : 0;
  s[1] = local.non_finite ? 1 : 0;
  s[2] = local.weight_total;
  s[3] = local.loss * local.weight_total;
  s[4] = static_cast<double>(local.samples);
  for (std::size_t k = 0; k < any_grad.size(); ++k) s[5 + k] = any_grad[k];
  group_.allreduceSum(status_, "the cross-node status allreduce");
  StepTotals out;
  out.failed = s[0] > 0;
  out.non_finite = s[1] > 0;
  out.weight_total = s[2];
  out.loss = s[2] > 0 ? s[3] / s[2] : 0;
  out.samples = static_cast<std::int64_t>(s[4]);
  for (std::size_t k = 0; k < any_grad.size(); ++k) any_grad[k] = s[5 + k] > 0 ? 1 : 0;
  return out;
}

void CrossNode::reduceResult(int result, const std::vector<std::uint8_t>& any_grad, double total) {
  std::byte* out = segment_.result(result);
  const auto& params = binding_.params();
  for (Span& span : spans_)
    group_.allreduceSum(span.view[result], "the cross-node gradient allreduce");
  for (std::size_t k = 0; k < params.size(); ++k) {
    if (!any_grad[k]) continue;
    scaleInPlace(elementTypeOf(params[k].dtype), out + params[k].offset,
                 static_cast<std::size_t>(params[k].tensor.numel()), 1.0 / total);
  }
}

void CrossNode::gatherBuffers() {
  for (at::Tensor& b : slot0_buffers_) {
    if (group_.rank() != 0) std::memset(b.data_ptr(), 0, b.nbytes());
    group_.allreduceSum(b, "the cross-node buffer allreduce");
  }
}

void CrossNode::checkParameters(std::int64_t step) {
  std::uint64_t h = 14695981039346656037ull;
  h = fnv1a(binding_.paramRegion(), segment_.layout.sizes.param_bytes, h);
  const auto sums = group_.allgather(static_cast<std::int64_t>(h), "the parameter checksum");
  std::vector<int> differ;
  for (int r = 0; r < group_.size(); ++r)
    if (sums[r] != sums[0]) differ.push_back(r);
  if (!differ.empty())
    throw NodeFailed(fmt::format("gradagg: before step {} the parameters of node(s) {} differ "
                                 "from node 0's (checksums); the nodes diverged",
                                 step, fmt::join(differ, ", ")),
                     group_.rank());
}

}  // namespace gradagg::detail
