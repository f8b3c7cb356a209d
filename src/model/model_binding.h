// ModelBinding: the model's parameters and buffers, listed once, and their home
// in the segment's snapshot. The parent's tensors keep their identity (the
// optimizer still holds them) but view shared memory, so optimizer.step()
// updates the snapshot in place and no publish copy is needed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <gradagg/model.h>

namespace gradagg::detail {

struct TensorEntry {
  std::string name;          // as in named_parameters() / named_buffers()
  at::Tensor tensor;         // the model's own tensor, kept alive here
  std::uint64_t offset = 0;  // inside the parameter (or buffer) region
  std::uint64_t bytes = 0;   // numel * element size
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<std::int64_t> sizes;
  bool requires_grad = false;  // fixed at construction
};

// The parameter dtypes gradagg serves, in the order of their runs in the flat gradient.
inline constexpr c10::ScalarType kParameterDtypes[] = {
    c10::ScalarType::Float, c10::ScalarType::Double, c10::ScalarType::BFloat16,
    c10::ScalarType::Half};

// A view of entry's bytes at `region + entry.offset`, with its shape and dtype.
at::Tensor viewAt(const TensorEntry& entry, std::byte* region);

class ModelBinding {
 public:
  // Lists parameters and buffers (each tensor once, even if registered twice)
  // and checks them: CPU, dense, parameters float32, float64, bfloat16 or float16.
  // Throws InvalidArgument naming the first tensor it cannot serve.
  explicit ModelBinding(const ModelView& model);
  ~ModelBinding() { release(); }
  ModelBinding(const ModelBinding&) = delete;
  ModelBinding& operator=(const ModelBinding&) = delete;

  // The parameter and buffer regions: every tensor's bytes, each on its own
  // 64-byte lines (at least one).
  std::uint64_t paramBytes() const { return param_bytes_; }
  std::uint64_t bufferBytes() const { return buffer_bytes_; }

  // Parent, once: copy every value into the snapshot and point the model's
  // tensors at it. `segment_begin/end` bound the whole segment, for release().
  void adopt(std::byte* params, std::byte* buffers, const std::byte* segment_begin,
             const std::byte* segment_end);
  // Parent, every step: each tensor must still live in the snapshot. One whose
  // storage was replaced with the same shape and dtype (e.g. by load) is copied
  // back in; a changed shape, dtype or requires_grad is an InvalidArgument.
  void verify();
  // Gives every tensor (and any .grad) that views the segment its own memory back.
  void release() noexcept;

  std::vector<TensorEntry>& params() { return params_; }
  std::vector<TensorEntry>& buffers() { return buffers_; }
  const std::vector<TensorEntry>& params() const { return params_; }
  const std::vector<TensorEntry>& buffers() const { return buffers_; }
  std::byte* paramRegion() const { return param_region_; }
  std::byte* bufferRegion() const { return buffer_region_; }

 private:
  void verifyOne(TensorEntry& e, std::byte* region, const char* kind);

  std::vector<TensorEntry> params_;
  std::vector<TensorEntry> buffers_;
  std::uint64_t param_bytes_ = 0;
  std::uint64_t buffer_bytes_ = 0;
  std::byte* param_region_ = nullptr;
  std::byte* buffer_region_ = nullptr;
  const std::byte* segment_begin_ = nullptr;
  const std::byte* segment_end_ = nullptr;
};

// "[2, 3] float32"
std::string describeTensor(const at::Tensor& t);
std::string describeShape(c10::IntArrayRef sizes, c10::ScalarType dtype);

}  // namespace gradagg::detail
