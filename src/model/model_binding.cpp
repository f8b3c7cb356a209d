#include "model/model_binding.h"

#include "runtime/segment.h"  // kAlign, alignUp

#include <algorithm>
#include <iterator>
#include <unordered_set>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <gradagg/errors.h>

namespace gradagg::detail {

std::string describeShape(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  return fmt::format("[{}] {}", fmt::join(sizes, ", "), c10::toString(dtype));
}

std::string describeTensor(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string where = t.is_cpu() ? "" : fmt::format(" on {}", t.device().str());
  std::string layout = t.is_sparse() ? " sparse" : "";
  return describeShape(t.sizes(), t.scalar_type()) + layout + where;
}

at::Tensor viewAt(const TensorEntry& e, std::byte* region) {
  return at::from_blob(region + e.offset, e.sizes, at::TensorOptions().dtype(e.dtype));
}

namespace {

std::uint64_t slotBytes(std::uint64_t bytes) {
  return std::max<std::uint64_t>(kAlign, alignUp(bytes, kAlign));
}

void checkCommon(const std::string& kind, const std::string& name, const at::Tensor& t) {
  if (!t.is_cpu())
    throw InvalidArgument(fmt::format(
        "{} '{}': expected a CPU tensor, got {}. gradagg forks its workers and CUDA state "
        "cannot cross fork; keep the model on the CPU",
        kind, name, describeTensor(t)));
  if (t.layout() != c10::kStrided)
    throw InvalidArgument(fmt::format("{} '{}': expected a dense (strided) tensor, got {}", kind,
                                      name, describeTensor(t)));
}

}  // namespace

ModelBinding::ModelBinding(const ModelView& model) {
  std::unordered_set<const c10::TensorImpl*> seen;
  // Each tensor once, checked the first time it is listed.
  auto first = [&](const char* kind, const NamedTensor& item) {
    const at::Tensor& t = item.tensor;
    if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) return false;
    checkCommon(kind, item.name, t);
    return true;
  };
  for (const NamedTensor& item : model.parameters) {
    if (!first("parameter", item)) continue;
    const at::Tensor& t = item.tensor;
    if (std::find(std::begin(kParameterDtypes), std::end(kParameterDtypes), t.scalar_type()) ==
        std::end(kParameterDtypes))
      throw InvalidArgument(
          fmt::format("parameter '{}': expected float32, float64, bfloat16 or float16, got {}",
                      item.name, describeTensor(t)));
    params_.push_back(TensorEntry{item.name, t, 0, static_cast<std::uint64_t>(t.nbytes()),
                                  t.scalar_type(), t.sizes().vec(), t.requires_grad()});
  }
  // Offsets grouped by dtype, float32 first: each dtype's gradients are one
  // contiguous run of the flat gradient (one collective per dtype across nodes).
  for (const auto dtype : kParameterDtypes) {
    for (TensorEntry& e : params_) {
      if (e.dtype != dtype) continue;
      e.offset = param_bytes_;
      param_bytes_ += slotBytes(e.bytes);
    }
  }
  for (const NamedTensor& item : model.buffers) {
    if (!first("buffer", item)) continue;
    const at::Tensor& t = item.tensor;
    TensorEntry e{item.name,
                  t,
                  buffer_bytes_,
                  static_cast<std::uint64_t>(t.nbytes()),
                  t.scalar_type(),
                  t.sizes().vec(),
                  false};
    buffer_bytes_ += slotBytes(e.bytes);
    buffers_.push_back(std::move(e));
  }
}

void ModelBinding::adopt(std::byte* params, std::byte* buffers, const std::byte* segment_begin,
                         const std::byte* segment_end) {
  at::NoGradGuard no_grad;
  param_region_ = params;
  buffer_region_ = buffers;
  segment_begin_ = segment_begin;
  segment_end_ = segment_end;
  for (auto* list : {&params_, &buffers_}) {
    for (TensorEntry& e : *list) {
      std::byte* region = list == &params_ ? params : buffers;
      at::Tensor view = viewAt(e, region);
      view.copy_(e.tensor);
      e.tensor.set_data(view);
    }
  }
}

void ModelBinding::verifyOne(TensorEntry& e, std::byte* region, const char* kind) {
  const at::Tensor& t = e.tensor;
  if (t.data_ptr() == region + e.offset && t.sizes().equals(e.sizes) &&
      t.scalar_type() == e.dtype && t.is_contiguous())
    return;
  if (!t.is_cpu() || t.layout() != c10::kStrided || !t.sizes().equals(e.sizes) ||
      t.scalar_type() != e.dtype)
    throw InvalidArgument(fmt::format(
        "{} '{}' changed from {} to {} since the Aggregator was created; the model's layout is "
        "fixed at construction (create a new Aggregator for a new layout)",
        kind, e.name, describeShape(e.sizes, e.dtype), describeTensor(t)));
  // Same shape and dtype, new storage (e.g. set_data or a load): take its value back in.
  at::NoGradGuard no_grad;
  at::Tensor view = viewAt(e, region);
  view.copy_(t);
  e.tensor.set_data(view);
}

void ModelBinding::verify() {
  for (TensorEntry& e : params_) {
    if (e.tensor.requires_grad() != e.requires_grad)
      throw InvalidArgument(fmt::format(
          "parameter '{}': requires_grad changed to {} since the Aggregator was created; the "
          "workers' replicas were forked with {}",
          e.name, e.tensor.requires_grad(), e.requires_grad));
    verifyOne(e, param_region_, "parameter");
  }
  for (TensorEntry& e : buffers_) verifyOne(e, buffer_region_, "buffer");
}

void ModelBinding::release() noexcept {
  if (param_region_ == nullptr && buffer_region_ == nullptr) return;
  const auto inSegment = [&](const at::Tensor& t) {
    if (!t.defined()) return false;
    const auto* p = static_cast<const std::byte*>(t.data_ptr());
    return p >= segment_begin_ && p < segment_end_;
  };
  try {
    at::NoGradGuard no_grad;
    for (auto* list : {&params_, &buffers_}) {
      for (TensorEntry& e : *list) {
        if (inSegment(e.tensor)) e.tensor.set_data(e.tensor.detach().clone());
        if (inSegment(e.tensor.grad())) e.tensor.mutable_grad() = e.tensor.grad().clone();
      }
    }
  } catch (...) {
    // Out of memory while copying back: nothing better can be done in a destructor.
  }
  param_region_ = buffer_region_ = nullptr;
}

}  // namespace gradagg::detail
