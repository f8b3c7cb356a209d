#include "step/flat.h"

#include <algorithm>
#include <array>

#include "model/model_binding.h"
#include "step/layout.h"

namespace gradagg::detail {

ElementType elementTypeOf(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Double:
      return ElementType::kFloat64;
    case c10::ScalarType::BFloat16:
      return ElementType::kBFloat16;
    case c10::ScalarType::Half:
      return ElementType::kFloat16;
    default:
      return ElementType::kFloat32;
  }
}

std::vector<FlatTensor> flatParams(const ModelBinding& binding) {
  std::vector<FlatTensor> flat;
  for (const TensorEntry& p : binding.params())
    flat.push_back(FlatTensor{p.offset, static_cast<std::uint64_t>(p.tensor.numel()),
                              elementTypeOf(p.dtype), p.requires_grad});
  return flat;
}

std::vector<ByteRange> splitRanges(std::uint64_t total_bytes, int parts) {
  std::vector<ByteRange> out(static_cast<std::size_t>(std::max(parts, 1)));
  const std::uint64_t lines = (total_bytes + kAlign - 1) / kAlign;
  for (std::size_t r = 0; r < out.size(); ++r) {
    out[r].begin = std::min(total_bytes, lines * r / out.size() * kAlign);
    out[r].end = std::min(total_bytes, lines * (r + 1) / out.size() * kAlign);
  }
  return out;
}

std::vector<ByteRange> splitRanges(ByteRange whole, int parts) {
  std::vector<ByteRange> out = splitRanges(whole.end - whole.begin, parts);
  for (ByteRange& r : out) {
    r.begin += whole.begin;
    r.end += whole.begin;
  }
  return out;
}

void reduceRange(const std::vector<FlatTensor>& params, ByteRange range, std::byte* out,
                 const std::byte* const* slots, const double* w, int n) {
  std::array<const void*, kMaxSlots> in{};
  for (std::size_t k = 0; k < params.size(); ++k) {
    const FlatTensor& p = params[k];
    const std::size_t size = elementBytes(p.type);
    const std::uint64_t lo = std::max(range.begin, p.offset);
    const std::uint64_t hi = std::min(range.end, p.offset + p.count * size);
    if (lo >= hi || !p.trainable) continue;
    for (int i = 0; i < n; ++i) in[i] = slots[i] + lo;
    weightedSum(p.type, out + lo, in.data(), w, n, (hi - lo) / size);
  }
}

}  // namespace gradagg::detail
