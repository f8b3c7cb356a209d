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
      out += fmt::format("{} {} {}\n", list == &binding.params() ? "parameter" : "buffer",
                         e.name, describeShape(e.sizes, e.dtype));
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

CrossNode::CrossNode(const NodeOptions& options, ModelBinding& binding, const Layout& layout,
                     std::byte* base, int workers)
    : group_(options), binding_(binding), layout_(layout), base_(base) {
  // The same model everywhere, checked by comparing layouts through the store.
  const std::string mine = describeLayout(binding);
  const auto all = group_.exchange("layout", mine);
  for (int r = 0; r < group_.size(); ++r) {
    if (all[r] == all[0]) continue;
    throw InvalidArgument(fmt::format(
        "gradagg: node {} has a different model from node 0 (this is node {}): {}", r,
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
    scratch_.push_back(v.clone());
  }
  // Runs of parameters of one dtype, each one collective.
  const auto& params = binding.params();
  for (std::size_t k = 0; k < params.size();) {
    std::size_t j = k;
    while (j + 1 < params.size() && params[j + 1].dtype == params[k].dtype) ++j;
    const std::uint64_t begin = params[k].offset;
    const std::uint64_t end = params[j].offset + params[j].bytes;
    const std::int64_t count = static_cast<std::int64_t>((end - begin) / c10::elementSize(params[k].dtype));
    Span span;
    span.offset = begin;
    for (int i = 0; i < 2; ++i)
      span.view[i] = at::from_blob(base_ + layout_.result_offset[i] + begin, {count},
                                   at::TensorOptions().dtype(params[k].dtype));
    spans_.push_back(std::move(span));
    k = j + 1;
  }
  status_ = at::zeros({static_cast<std::int64_t>(5 + params.size())}, at::kDouble);
}

CrossNode::Status CrossNode::exchangeStatus(bool failed, bool non_finite, double total,
                                            double weighted_loss, std::int64_t samples,
                                            std::vector<std::uint8_t>& any_grad) {
  double* s = status_.data_ptr<double>();
  s[0] = failed ? 1 : 0;
  s[1] = non_finite ? 1 : 0;
  s[2] = total;
  s[3] = weighted_loss * total;
  s[4] = static_cast<double>(samples);
  for (std::size_t k = 0; k < any_grad.size(); ++k) s[5 + k] = any_grad[k];
  group_.allreduceSum(status_, "the cross-node status allreduce");
  Status out;
  out.failed = static_cast<int>(s[0]);
  out.non_finite = static_cast<int>(s[1]);
  out.total = s[2];
  out.loss = s[2] > 0 ? s[3] / s[2] : 0;
  out.samples = static_cast<std::int64_t>(s[4]);
  for (std::size_t k = 0; k < any_grad.size(); ++k) any_grad[k] = s[5 + k] > 0 ? 1 : 0;
  return out;
}

void CrossNode::reduceResult(int result, const std::vector<std::uint8_t>& local_any,
                             const std::vector<std::uint8_t>& global_any, double total) {
  std::byte* out = base_ + layout_.result_offset[result];
  const auto& params = binding_.params();
  for (std::size_t k = 0; k < params.size(); ++k)
    if (!local_any[k]) std::memset(out + params[k].offset, 0, params[k].bytes);
  for (Span& span : spans_) group_.allreduceSum(span.view[result], "the cross-node gradient allreduce");
  for (std::size_t k = 0; k < params.size(); ++k) {
    if (!global_any[k]) continue;
    const auto type = params[k].dtype == at::kDouble ? ElementType::kFloat64 : ElementType::kFloat32;
    scaleInPlace(type, out + params[k].offset, static_cast<std::size_t>(params[k].tensor.numel()),
                 1.0 / total);
  }
}

void CrossNode::gatherBuffers(const std::byte* slot0_buffers) {
  auto& buffers = binding_.buffers();
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    if (group_.rank() == 0)
      std::memcpy(scratch_[b].data_ptr(), slot0_buffers + buffers[b].offset, buffers[b].bytes);
    else
      std::memset(scratch_[b].data_ptr(), 0, buffers[b].bytes);
    group_.allreduceSum(scratch_[b], "the cross-node buffer allreduce");
  }
}

void CrossNode::commitBuffers() {
  auto& buffers = binding_.buffers();
  for (std::size_t b = 0; b < buffers.size(); ++b)
    std::memcpy(binding_.bufferRegion() + buffers[b].offset, scratch_[b].data_ptr(),
                buffers[b].bytes);
}

void CrossNode::checkParameters(std::int64_t step) {
  std::uint64_t h = 14695981039346656037ull;
  h = fnv1a(binding_.paramRegion(), layout_.sizes.param_bytes, h);
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
