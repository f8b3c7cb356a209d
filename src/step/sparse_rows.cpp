#include "step/sparse_rows.h"

#include <ATen/ATen.h>

#include "runtime/segment.h"

namespace gradagg::detail {

RowMap rowMap(const std::vector<TensorEntry>& params) {
  RowMap map;
  std::uint64_t at = 0;
  for (const TensorEntry& p : params) {
    const std::int64_t rows = p.sizes.empty() ? 0 : p.sizes[0];
    map.offset.push_back(at);
    map.rows.push_back(rows);
    at += static_cast<std::uint64_t>(rows);
  }
  map.bytes = alignUp(at, kAlign);
  return map;
}

void markRows(std::uint8_t* rows, std::int64_t row_count, const at::Tensor& grad) {
  const at::Tensor first = grad._indices().select(0, 0).contiguous();
  const std::int64_t* row = first.data_ptr<std::int64_t>();
  for (std::int64_t i = 0, n = first.numel(); i < n; ++i)
    if (row[i] >= 0 && row[i] < row_count) rows[row[i]] = 1;
}

at::Tensor sparseGradient(const at::Tensor& mean, const std::uint8_t* touched) {
  std::vector<std::int64_t> marked;
  for (std::int64_t r = 0, n = mean.size(0); r < n; ++r)
    if (touched[r] != 0) marked.push_back(r);
  const auto count = static_cast<std::int64_t>(marked.size());
  at::Tensor indices = at::empty({1, count}, at::kLong);
  std::copy(marked.begin(), marked.end(), indices.data_ptr<std::int64_t>());
  at::Tensor values = mean.index_select(0, indices.select(0, 0));
  return at::sparse_coo_tensor(indices, values, mean.sizes())._coalesced_(true);
}

}  // namespace gradagg::detail
