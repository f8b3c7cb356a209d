// The population segment: plain data at fixed offsets, no pointers, no containers.
//
// Protocol. The parent drives generations through the control channel
// (runtime/control.h) over the header's command line; each member is the serve
// loop (runtime/serve.h) around its own commands: it writes the fields, sets `remaining`
// to N, bumps command_seq (release) and wakes the members. kTrain: each member
// trains publish_interval steps, publishes a snapshot, and arrives (decrements
// `remaining`, the last wakes the parent). kExploit: each member reads every
// peer's latest snapshot (nobody publishes in this phase, so all read the same
// versions and a run is deterministic), its policy decides, it copies a donor
// into its replica, explores, and arrives. kPublish: a member that copied
// publishes its new state (so the parent's snapshots and checkpoints show it).
// The parent's waits are the generation's barriers: publish -> barrier ->
// decide/copy -> barrier -> publish copies -> barrier. Its waits have the step
// deadline and check
// every member's liveness each 50 ms slice; members check that the parent lives.
//
// Snapshots are a seqlock over 3 slots per member. Writer (member r only):
// slot w = (latest + 1) % 3; seq[w] = odd (relaxed), release fence, write meta
// and payload, seq[w] = even (release), latest = w (release). Reader (anyone):
// w = latest (acquire), s = seq[w] (acquire), odd -> retry, copy, acquire fence,
// seq[w] again: changed -> retry. A writer killed mid-write leaves seq[w] odd
// and `latest` on the previous complete slot, so readers never see a torn copy.
//
//   0               +----------------------------------------------------+
//                   | PopHeader: magic, version, sizes, offsets          |
//                   |   command line: command_seq, command, generation   |
//                   |   arrive line: remaining                           |
//   members_offset  +----------------------------------------------------+
//                   | member 0: MemberControl (phase, status, latest,    |
//                   |           copy event, message)                     |
//                   |   slot 0: SlotMeta | parameters | buffers | optim  |
//                   |   slot 1: ...                                      |
//                   |   slot 2: ...                                      |
//   + member_stride +----------------------------------------------------+
//                   | member 1 ... member N-1                            |
//   segment_bytes   +----------------------------------------------------+
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "runtime/segment.h"  // kAlign, alignUp, kMessageBytes

namespace gradagg::detail::pop {

inline constexpr std::uint64_t kPopMagic = 0x3170'6f70'6761'7267ULL;  // "gragpop1", little-endian
inline constexpr std::uint32_t kPopLayoutVersion = 1;
inline constexpr int kSlots = 3;
inline constexpr int kMaxHp = 16;

enum class Command : std::uint32_t { kNone = 0, kTrain = 1, kExploit = 2, kStop = 3, kPublish = 4 };
enum class Status : std::uint32_t { kOk = 0, kFailed = 1 };
// How a member starts (MemberControl::restart).
enum class Restart : std::uint32_t {
  kFirst = 0,          // a first start: initialise (or resume the run's checkpoint)
  kOwesArrival = 1,    // forked again: start from its latest slot, arrive for the current command
  kArrivedAlready = 2  // the same, but the member it replaces had arrived for the command
};

// At the start of each slot. Written by its member only, under the slot's seq.
struct alignas(kAlign) SlotMeta {
  // Odd while the member writes this slot; even (and larger) after each write.
  std::atomic<std::uint32_t> seq;
  std::uint32_t hp_count;
  std::uint64_t version;        // 1, 2, ...: the member's publish count
  std::int64_t step;            // steps trained when published
  std::int64_t last_copy_step;  // step of its last copy, -1 before any
  double score;
  std::uint64_t optimizer_bytes;  // used bytes of the optimizer area
  double hp[kMaxHp];              // in the parent's name order
};

// One per member. Written by that member, except where a field says the parent.
struct alignas(kAlign) MemberControl {
  // The member, as it moves (relaxed); read by the parent to name the phase.
  std::atomic<std::uint32_t> phase;
  // Slot holding the latest complete snapshot; stored (release) by the member
  // after the slot's seq went even; by the parent before fork when resuming.
  std::atomic<std::uint32_t> latest;
  // The command_seq this member last arrived for; stored (release) by the member
  // just before it decrements `remaining` (and by the parent before the first
  // fork: "not arrived"). The parent reads it to name a late member, and when the
  // member died, to know whether a restarted member still owes that arrival.
  std::atomic<std::uint32_t> done_seq;
  // A Restart. Written by the parent before it forks a replacement (max_restarts).
  std::uint32_t restart;
  // Written by the member before it arrives; read by the parent after
  // `remaining` hit 0. The parent sets it to kOk before it forks a replacement.
  std::uint32_t status;
  // Written by the parent after it forked the member.
  std::int32_t pid;
  // kExploit outcome: copied != 0 when it copied `donor` (version donor_version).
  // The parent clears `copied` before it forks a replacement.
  std::uint32_t copied;
  std::int32_t donor;
  std::uint64_t donor_version;
  std::int64_t copy_step;
  double own_score, donor_score;
  double hp_before[kMaxHp], hp_after[kMaxHp];
  char message[kMessageBytes];
};

// Sizes everything is derived from.
struct PopSizes {
  std::uint32_t workers = 0;
  std::uint32_t hp_count = 0;
  std::uint64_t param_bytes = 0;  // aligned, as ModelBinding lists them
  std::uint64_t buffer_bytes = 0;
  std::uint64_t optimizer_bytes = 0;  // capacity of each slot's optimizer area
};

struct PopLayout {
  PopSizes sizes;
  std::uint64_t members_offset = 0;
  std::uint64_t member_stride = 0;
  std::uint64_t slots_offset = 0;  // within a member, after MemberControl
  std::uint64_t slot_stride = 0;
  std::uint64_t payload_offset = 0;  // within a slot, after SlotMeta: params | buffers | optim
  std::uint64_t segment_bytes = 0;
  static PopLayout plan(const PopSizes& s, std::size_t page_bytes);
  std::uint64_t payloadBytes() const {
    return sizes.param_bytes + sizes.buffer_bytes + sizes.optimizer_bytes;
  }
  // Inside a payload (a slot's, or a private copy of one): parameters at 0,
  // then buffers, then the optimizer state.
  std::byte* buffersIn(std::byte* payload) const { return payload + sizes.param_bytes; }
  std::byte* optimizerIn(std::byte* payload) const {
    return payload + sizes.param_bytes + sizes.buffer_bytes;
  }
};

struct alignas(kAlign) PopHeader {
  // ---- identity: written by the parent before fork.
  std::uint64_t magic;
  std::uint32_t layout_version;
  std::uint32_t resumed;  // 1: members start from their latest slot (the checkpoint)
  PopLayout layout;
  // ---- command line: written by the parent while every member waits; then
  // command_seq is bumped (release) and woken. Members read after seeing it change.
  alignas(kAlign) std::atomic<std::uint32_t> command_seq;
  std::uint32_t command;  // a Command
  std::int64_t generation;
  // ---- arrive line: set to N by the parent before each command (and before
  // fork, for start-up); each member decrements it once when its part is done;
  // the one reaching 0 wakes the parent.
  alignas(kAlign) std::atomic<std::uint32_t> remaining;
};

static_assert(sizeof(PopHeader) % kAlign == 0 && sizeof(MemberControl) % kAlign == 0);
static_assert(sizeof(SlotMeta) % kAlign == 0);
static_assert(offsetof(SlotMeta, seq) == 0 && offsetof(PopHeader, magic) == 0);
static_assert(kMaxHp == 16, "keep in step with PopulationOptions::kMaxHyperparams");

// One member's view: its control block and its three slots.
struct MemberArea {
  MemberControl* control = nullptr;
  std::byte* slots = nullptr;
  std::uint64_t slot_stride = 0;
  std::uint64_t payload_offset = 0;
  SlotMeta* meta(int slot) const { return reinterpret_cast<SlotMeta*>(slots + slot_stride * slot); }
  std::byte* payload(int slot) const { return slots + slot_stride * slot + payload_offset; }
};
MemberArea memberArea(std::byte* base, const PopLayout& layout, int rank);

// What a snapshot says besides its payload (a plain copy of SlotMeta's values).
struct MetaValues {
  std::uint64_t version = 0;
  std::int64_t step = 0;
  std::int64_t last_copy_step = -1;
  double score = 0;
  std::uint64_t optimizer_bytes = 0;
  std::uint32_t hp_count = 0;
  double hp[kMaxHp] = {};
};

// Writer (the member only): writes `meta` and fill(payload) into the next slot
// and makes it the latest. `midway` (may be empty) runs after half the payload
// was filled, for tests. Returns the slot written.
int publish(const MemberArea& m, const MetaValues& meta,
            const std::function<void(std::byte* payload)>& fill,
            const std::function<void()>& midway);
// Reader (anyone): copies the latest complete snapshot's meta and the first
// `payload_bytes(meta)` bytes of its payload into `out` (may be null for meta
// only). Retries while the writer works on that slot; false after max_retries.
bool read(const MemberArea& m, MetaValues* meta, std::byte* out,
          const std::function<std::uint64_t(const MetaValues&)>& payload_bytes, int max_retries);

}  // namespace gradagg::detail::pop
