// The population segment's layout and its seqlock snapshots (torch-free).
// See population/layout.h for the protocol.
#include <cstring>
#include <functional>

#include "population/layout.h"
#include "runtime/check.h"

namespace gradagg::detail::pop {

PopLayout PopLayout::plan(const PopSizes& s, std::size_t page_bytes) {
  PopLayout l;
  l.sizes = s;
  l.sizes.optimizer_bytes = alignUp(s.optimizer_bytes, kAlign);
  l.payload_offset = sizeof(SlotMeta);
  l.slot_stride = alignUp(l.payload_offset + l.payloadBytes(), kAlign);
  l.slots_offset = sizeof(MemberControl);
  l.member_stride = alignUp(l.slots_offset + l.slot_stride * kSlots, kAlign);
  l.members_offset = sizeof(PopHeader);
  l.segment_bytes = alignUp(l.members_offset + l.member_stride * s.workers, page_bytes);
  return l;
}

MemberArea memberArea(std::byte* base, const PopLayout& layout, int rank) {
  std::byte* m = base + layout.members_offset + layout.member_stride * rank;
  return MemberArea{reinterpret_cast<MemberControl*>(m), m + layout.slots_offset,
                    layout.slot_stride, layout.payload_offset};
}

int publish(const MemberArea& m, const MetaValues& v,
            const std::function<void(std::byte* payload)>& fill,
            const std::function<void()>& midway) {
  const int w = static_cast<int>((m.control->latest.load(std::memory_order_relaxed) + 1) % kSlots);
  SlotMeta* meta = m.meta(w);
  // An odd seq here means a writer was killed mid-write: start from the next even.
  const std::uint32_t even = (meta->seq.load(std::memory_order_relaxed) + 1) & ~1u;
  meta->seq.store(even + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  meta->hp_count = v.hp_count;
  meta->version = v.version;
  meta->step = v.step;
  meta->last_copy_step = v.last_copy_step;
  meta->score = v.score;
  meta->optimizer_bytes = v.optimizer_bytes;
  std::memcpy(meta->hp, v.hp, sizeof(meta->hp));
  if (midway) midway();
  fill(m.payload(w));
  meta->seq.store(even + 2, std::memory_order_release);
  m.control->latest.store(static_cast<std::uint32_t>(w), std::memory_order_release);
  return w;
}

bool read(const MemberArea& m, MetaValues* out_meta, std::byte* out,
          const std::function<std::uint64_t(const MetaValues&)>& payload_bytes, int max_retries) {
  for (int attempt = 0; attempt <= max_retries; ++attempt) {
    const int w = static_cast<int>(m.control->latest.load(std::memory_order_acquire));
    GRADAGG_ENFORCE(w >= 0 && w < kSlots, "latest slot {}", w);
    const SlotMeta* meta = m.meta(w);
    const std::uint32_t s1 = meta->seq.load(std::memory_order_acquire);
    if (s1 & 1u) continue;
    MetaValues v;
    v.hp_count = meta->hp_count;
    v.version = meta->version;
    v.step = meta->step;
    v.last_copy_step = meta->last_copy_step;
    v.score = meta->score;
    v.optimizer_bytes = meta->optimizer_bytes;
    std::memcpy(v.hp, meta->hp, sizeof(v.hp));
    if (out != nullptr) {
      // A torn meta can give any size: bound it, the seq check rejects the copy anyway.
      std::uint64_t n = payload_bytes(v);
      n = std::min<std::uint64_t>(n, m.slot_stride - m.payload_offset);
      std::memcpy(out, m.payload(w), n);
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (meta->seq.load(std::memory_order_relaxed) != s1) continue;
    *out_meta = v;
    return true;
  }
  return false;
}

}  // namespace gradagg::detail::pop
