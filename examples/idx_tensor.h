// Tensors from IDX arrays (header-only, so idx.cpp stays torch-free and the
// only translation units that pay for ATen are the ones that use tensors anyway).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "idx.h"

namespace idx {

// A uint8 tensor with the array's dimensions, owning a copy of its bytes.
inline at::Tensor toTensor(const IdxArray& array) {
  std::vector<std::int64_t> sizes(array.dims.begin(), array.dims.end());
  auto view = at::from_blob(const_cast<std::uint8_t*>(array.data.data()), sizes, at::kByte);
  return view.clone();
}

// Images as float32 {n, rows * cols} in [0, 1]; labels as int64 {n}.
inline at::Tensor imagesAsFloatRows(const IdxArray& images) {
  auto bytes = toTensor(images);
  return bytes.reshape({bytes.size(0), -1}).to(at::kFloat).div_(255.0);
}
inline at::Tensor labelsAsLong(const IdxArray& labels) { return toTensor(labels).to(at::kLong); }

}  // namespace idx
