// Sparse gradients (Embedding(sparse=True), EmbeddingBag(sparse=True)): the
// slots stay dense, and each worker also marks which rows its sparse gradient
// touched; the parent hands on a sparse, coalesced .grad over the union of the
// touched rows, as one process's gradient after coalesce(), so SparseAdam and
// SGD with sparse gradients see what they would see in one process.
//
// Rows: one byte per row (the first dimension) of every parameter, at
// RowMap::offset[k] in a slot's rows (step/layout.h); 0-dimensional
// parameters have none. The cost is a byte per row per worker; the dense slot
// costs the full gradient per worker, as for any parameter.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "model/model_binding.h"

namespace gradagg::detail {

// The has-grad flag bits a worker sets per parameter (its slot's flags): a
// dense gradient, a sparse one; both when its micro-batches differed.
inline constexpr std::uint8_t kDenseGrad = 1;
inline constexpr std::uint8_t kSparseGrad = 2;

// Whether parameter flags (OR-ed over the workers, or nodes) give a sparse
// .grad: every gradient it received was sparse.
inline bool sparseOnly(std::uint8_t flags) { return flags == kSparseGrad; }

struct RowMap {
  std::vector<std::uint64_t> offset;  // per parameter, into a slot's rows
  std::vector<std::int64_t> rows;     // per parameter: its first dimension, or 0
  std::uint64_t bytes = 0;            // the total, aligned to 64 bytes
};
RowMap rowMap(const std::vector<TensorEntry>& params);

// In a worker's gradient hook: marks the rows `grad` (sparse COO) touches.
void markRows(std::uint8_t* rows, std::int64_t row_count, const at::Tensor& grad);

// In the parent: the sparse, coalesced gradient of the rows marked in
// `touched`, with the values of `mean` (the dense mean gradient) there.
at::Tensor sparseGradient(const at::Tensor& mean, const std::uint8_t* touched);

}  // namespace gradagg::detail
