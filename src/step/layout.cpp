#include "step/layout.h"

#include <cstring>
#include <limits>

#include <fmt/format.h>

namespace gradagg::detail {

Layout Layout::plan(const LayoutSizes& s, std::size_t page_bytes) {
  Layout l;
  l.sizes = s;
  l.control_offset = alignUp(sizeof(Header), kAlign);
  l.weights_offset = alignUp(l.control_offset + sizeof(WorkerControl) * s.workers, kAlign);
  l.message_offset = alignUp(l.weights_offset + sizeof(SlotWeight) * s.workers, page_bytes);
  l.snapshot_offset = alignUp(l.message_offset + s.message_bytes, page_bytes);
  l.snapshot_buffers_offset = l.snapshot_offset + s.param_bytes;
  l.result_offset[0] = alignUp(l.snapshot_buffers_offset + s.buffer_bytes, page_bytes);
  l.result_bytes = s.param_bytes + s.tail_bytes;
  l.result_offset[1] = l.result_offset[0] + l.result_bytes;
  l.slots_offset = alignUp(l.result_offset[1] + l.result_bytes, kAlign);
  l.slot_flags_offset = s.param_bytes;
  l.slot_rows_offset = alignUp(l.slot_flags_offset + s.param_count, kAlign);
  l.slot_buffers_offset = alignUp(l.slot_rows_offset + s.row_bytes, kAlign);
  l.slot_bytes = alignUp(l.slot_buffers_offset + s.buffer_bytes, kAlign);
  l.segment_bytes = alignUp(l.slots_offset + l.slot_bytes * s.workers, page_bytes);
  return l;
}

bool Layout::operator==(const Layout& o) const {
  return sizes.workers == o.sizes.workers && sizes.param_count == o.sizes.param_count &&
         sizes.buffer_count == o.sizes.buffer_count && sizes.param_bytes == o.sizes.param_bytes &&
         sizes.buffer_bytes == o.sizes.buffer_bytes && sizes.tail_bytes == o.sizes.tail_bytes &&
         sizes.message_bytes == o.sizes.message_bytes && sizes.row_bytes == o.sizes.row_bytes &&
         control_offset == o.control_offset && weights_offset == o.weights_offset &&
         message_offset == o.message_offset && snapshot_offset == o.snapshot_offset &&
         snapshot_buffers_offset == o.snapshot_buffers_offset &&
         result_offset[0] == o.result_offset[0] && result_offset[1] == o.result_offset[1] &&
         result_bytes == o.result_bytes && slots_offset == o.slots_offset &&
         slot_bytes == o.slot_bytes && slot_flags_offset == o.slot_flags_offset &&
         slot_rows_offset == o.slot_rows_offset && slot_buffers_offset == o.slot_buffers_offset &&
         segment_bytes == o.segment_bytes;
}

void initHeader(void* base, const Layout& layout, std::size_t page_bytes) {
  auto* h = static_cast<Header*>(base);
  h->magic = kMagic;
  h->layout_version = kLayoutVersion;
  h->header_bytes = sizeof(Header);
  h->page_bytes = page_bytes;
  h->layout = layout;
  h->command_seq.store(0, std::memory_order_relaxed);
  h->command = static_cast<std::uint32_t>(Command::kNone);
  h->training = 1;
  h->result_index = 0;
  h->step = 0;
  h->computed.store(0, std::memory_order_relaxed);
  h->reduced.store(0, std::memory_order_relaxed);
}

std::string validateHeader(const void* base, std::size_t mapping_bytes, const Layout* expected) {
  if (base == nullptr) return "no mapping";
  if (mapping_bytes < sizeof(Header))
    return fmt::format("mapping of {} bytes is smaller than the header ({} bytes)", mapping_bytes,
                       sizeof(Header));
  // Copy the identity out first: the checks below must not trust anything in place.
  Header h;
  std::memcpy(static_cast<void*>(&h), base, offsetof(Header, command_seq));
  if (h.magic != kMagic) return fmt::format("bad magic {:#x}, expected {:#x}", h.magic, kMagic);
  if (h.layout_version != kLayoutVersion)
    return fmt::format("layout version {}, expected {}", h.layout_version, kLayoutVersion);
  if (h.header_bytes != sizeof(Header))
    return fmt::format("header of {} bytes, expected {}", h.header_bytes, sizeof(Header));
  const std::uint64_t page = h.page_bytes;
  if (page < kAlign || page > (1u << 30) || (page & (page - 1)) != 0)
    return fmt::format("page size {} is not a power of two in [64, 1 GiB]", page);
  const LayoutSizes& s = h.layout.sizes;
  if (s.workers < 1 || s.workers > static_cast<std::uint32_t>(kMaxSlots))
    return fmt::format("{} workers", s.workers);
  // Bound every size so plan() cannot overflow: each below 2^48 bytes.
  constexpr std::uint64_t kLimit = std::uint64_t{1} << 48;
  if (s.param_bytes >= kLimit || s.buffer_bytes >= kLimit || s.tail_bytes >= kLimit ||
      s.message_bytes >= kLimit || s.row_bytes >= kLimit)
    return fmt::format(
        "sizes out of range: {} parameter bytes, {} buffer bytes, {} tail bytes, {} message "
        "bytes, {} row bytes",
        s.param_bytes, s.buffer_bytes, s.tail_bytes, s.message_bytes, s.row_bytes);
  if (s.param_bytes % kAlign != 0 || s.buffer_bytes % kAlign != 0 || s.tail_bytes % kAlign != 0 ||
      s.message_bytes % kAlign != 0 || s.row_bytes % kAlign != 0)
    return "region sizes are not multiples of 64 bytes";
  // Every tensor takes at least kAlign bytes (see ModelBinding).
  if (std::uint64_t{s.param_count} * kAlign > s.param_bytes)
    return fmt::format("{} parameters cannot fit in {} bytes", s.param_count, s.param_bytes);
  if (std::uint64_t{s.buffer_count} * kAlign > s.buffer_bytes)
    return fmt::format("{} buffers cannot fit in {} bytes", s.buffer_count, s.buffer_bytes);
  const Layout planned = Layout::plan(s, page);
  if (!(planned == h.layout)) return "stored offsets differ from those the sizes give";
  if (planned.segment_bytes > mapping_bytes)
    return fmt::format("segment of {} bytes does not fit in a mapping of {} bytes",
                       planned.segment_bytes, mapping_bytes);
  if (expected != nullptr && !(*expected == h.layout))
    return fmt::format(
        "layout differs from the one expected ({} workers, {} parameters, {} "
        "buffers expected; {}, {}, {} found)",
        expected->sizes.workers, expected->sizes.param_count, expected->sizes.buffer_count,
        s.workers, s.param_count, s.buffer_count);
  return {};
}

}  // namespace gradagg::detail
