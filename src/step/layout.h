// The segment's layout: plain data at fixed offsets, no pointers, no containers.
//
// The segment is one anonymous shared mapping. The parent creates it before it
// forks the workers, so each worker inherits it at the same address, and it never
// has a name in /dev/shm. Every region starts on a 64-byte boundary; the snapshot
// starts and ends on a page boundary so a worker can map it read-only.
//
//   0                 +---------------------------------------------------+
//                     | Header                                            |
//                     |   identity: magic, layout version, sizes, offsets |
//                     |   command line: command_seq, command, step, ...   |
//                     |   computed line: workers left to fill their slot  |
//                     |     and the step's summary (step_ok, D)           |
//                     |   reduced line: workers left to reduce their range|
//                     |   bucket lines: workers left per early bucket     |
//   control_offset    +---------------------------------------------------+
//                     | WorkerControl[0] | WorkerControl[1] | ... [N-1]   |
//   weights_offset    +---------------------------------------------------+
//                     | SlotWeight[0] | ... [N-1]  (the closer's)         |
//   message_offset    +---------------------------------------------------+ page
//                     | the step's message (the parent's; step/message.h) |  read-only
//   snapshot_offset   +---------------------------------------------------+ page
//                     | parameters  (the parent's master values)          |
//                     | buffers     (the parent's master values)          |
//   result_offset[0]  +---------------------------------------------------+ page
//                     | mean gradient A (the parent's .grad views ...)    |
//                     |   stage tail (the reduction stage's own bytes)    |
//   result_offset[1]  +---------------------------------------------------+
//                     | mean gradient B (... or these, every other step)  |
//                     |   stage tail                                      |
//   slots_offset      +---------------------------------------------------+
//                     | slot 0:  gradient | has-grad flags | rows | buffers|
//                     | slot 1:  ...                                      |
//                     | slot N-1                                          |
//   segment_bytes     +---------------------------------------------------+
//
// Parameter k's gradient lies at the same offset (TensorEntry::offset) in the
// snapshot's parameter area, in both results and in every slot's gradient area:
// one flat byte range [0, param_bytes) names the same parameters everywhere, so
// the workers can each reduce one range of it. Buffers do the same within
// [0, buffer_bytes). The two results alternate: a step writes the one that
// .grad does not view, and .grad moves to it only when the step succeeded, so a
// failed step leaves .grad as it was. Parameters are laid out grouped by dtype
// (float32 first), so each dtype's gradients are one contiguous run. Each result
// is followed by the stage tail: tail_bytes that belong to the reduction stage
// (step/stage.h), right after the gradient so that the stage can move both as
// one buffer; the step never reads them. A slot's rows hold one byte per row
// (first dimension) of every parameter, in parameter order: the rows a sparse
// gradient touched (step/sparse_rows.h), so that the parent can hand a sparse
// .grad on. The slot itself stays dense.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include <gradagg/options.h>
#include <gradagg/shard.h>

#include "runtime/segment.h"  // kAlign, alignUp, kMessageBytes

namespace gradagg::detail {

inline constexpr std::uint64_t kMagic = 0x3167'6761'6461'7267ULL;  // "gradagg1", little-endian
inline constexpr std::uint32_t kLayoutVersion = 7;
// Arrive lines for early buckets (step/buckets.h) in the header.
inline constexpr int kMaxEarlyBuckets = 64;
// The most workers one segment serves (Options::kMaxWorkers).
inline constexpr int kMaxSlots = Options::kMaxWorkers;

// What the parent asks of the workers; written before command_seq is bumped.
enum class Command : std::uint32_t { kNone = 0, kStep = 1, kStop = 2 };

// How a worker's part of a step ended; written before it arrives.
enum class SlotStatus : std::uint32_t {
  kOk = 0,
  kFailed = 1,     // an exception or a bad result; message says which
  kNonFinite = 2,  // a gradient or the loss was NaN or infinite; bad_param says where
};

// The sizes everything else is derived from.
struct LayoutSizes {
  std::uint32_t workers = 0;
  std::uint32_t param_count = 0;
  std::uint32_t buffer_count = 0;
  std::uint64_t param_bytes = 0;    // sum of aligned parameter sizes
  std::uint64_t buffer_bytes = 0;   // sum of aligned buffer sizes
  std::uint64_t tail_bytes = 0;     // the stage tail after each result (ReductionStage::tailBytes)
  std::uint64_t message_bytes = 0;  // room for a step's message (Options::message_bytes, aligned)
  std::uint64_t row_bytes = 0;      // a slot's rows: the parameters' first dimensions (aligned)
};

// Offsets of every region, all derived from LayoutSizes by plan().
struct Layout {
  LayoutSizes sizes;
  std::uint64_t control_offset = 0;
  std::uint64_t weights_offset = 0;
  std::uint64_t message_offset = 0;   // message_bytes, rounded up to pages
  std::uint64_t snapshot_offset = 0;  // parameters, then buffers at snapshot_buffers_offset
  std::uint64_t snapshot_buffers_offset = 0;
  std::uint64_t result_offset[2] = {0, 0};
  std::uint64_t result_bytes = 0;  // param_bytes, then the stage tail
  std::uint64_t slots_offset = 0;
  std::uint64_t slot_bytes = 0;           // stride between slots
  std::uint64_t slot_flags_offset = 0;    // within a slot; gradient is at 0
  std::uint64_t slot_rows_offset = 0;     // within a slot
  std::uint64_t slot_buffers_offset = 0;  // within a slot
  std::uint64_t segment_bytes = 0;

  static Layout plan(const LayoutSizes& sizes, std::size_t page_bytes);
  std::uint64_t slotOffset(int rank) const { return slots_offset + slot_bytes * rank; }
  bool operator==(const Layout& other) const;
};

// At offset 0. Identity fields are written once by the parent before fork;
// the protocol fields each sit on their own cache line.
struct alignas(kAlign) Header {
  // ---- identity: written by the parent at creation, read by workers at start.
  std::uint64_t magic;
  std::uint32_t layout_version;
  std::uint32_t header_bytes;  // sizeof(Header), so a different build is caught
  std::uint64_t page_bytes;
  Layout layout;

  // ---- command line. Written by the parent only, while every worker is idle:
  // the fields first, then command_seq incremented (release) and woken.
  // Workers wait for command_seq to change, then read the fields.
  alignas(kAlign) std::atomic<std::uint32_t> command_seq;
  std::uint32_t command;       // a Command
  std::uint32_t training;      // the parent model's is_training(), applied to every replica
  std::uint32_t result_index;  // which result (0 or 1) this step reduces into
  std::int64_t step;           // the step number the shard functions are told
  std::int64_t epoch;          // the step's BatchPosition (step(position)), or -1: none
  std::int64_t batch_index;
  std::int64_t command_ns;  // CLOCK_MONOTONIC when the command was issued (for wake_ms)

  // ---- computed line. Set to N + 1 by the parent before it bumps command_seq;
  // each worker takes one (acq_rel) when its slot and WorkerControl are
  // complete. The worker that takes the N-th (the closer: it sees every slot)
  // writes the step's summary below and every SlotWeight, then takes the last
  // one and wakes the others. A worker starts to reduce only after it read 0:
  // then every slot and the summary are complete.
  alignas(kAlign) std::atomic<std::uint32_t> computed;
  // The summary: written by the closer before it takes the last one from
  // `computed`; read by the workers after `computed` read 0 and by the parent
  // after `reduced` read 0.
  std::uint32_t step_ok;  // 1 when every worker's status is kOk: the workers reduce
  double weight_total;    // D = sum of the samples (or the worker count, equal weighting)

  // ---- reduced line. Set to N by the parent before it bumps command_seq (and
  // before it forks, for start-up); each worker decrements it once when its
  // range of the result is written (or, at start-up, when its replica is set
  // up); the one that reaches 0 wakes the parent, which waits on it.
  alignas(kAlign) std::atomic<std::uint32_t> reduced;

  // ---- bucket lines (early buckets; step/buckets.h). Line b is set to N by
  // the parent before it bumps command_seq, for each early bucket b of the
  // step; a worker takes one from it (acq_rel) once every gradient of bucket b
  // is in its slot and its `samples` is written, and, for whatever it has not
  // taken yet, just before it arrives on `computed` (also when it failed). The
  // parent waits on them in order, sums bucket b over the slots into the result
  // and hands it to the stage; the workers then reduce only the last bucket.
  alignas(kAlign) std::atomic<std::uint32_t> bucket_lines[kMaxEarlyBuckets];
};

// One named metric of a worker's step (ShardResult::metrics).
struct MetricEntry {
  char name[ShardResult::kMaxMetricNameBytes + 1];  // NUL-terminated
  double value;
};

// How long each phase of the last step took, in milliseconds (see WorkerReport).
struct PhaseTimes {
  double wake_ms;
  double load_ms;
  double shard_ms;
  double backward_ms;
  double write_ms;
  double barrier_ms;
  double reduce_ms;
};

// One per worker, after the header. Written by worker `rank` only, through its
// SlotWriter (step/slots.h); the parent reads it through SlotReader after that
// worker arrived, or after it died or timed out; the parent writes it only
// before it forks the worker (SlotReader::prepareStart).
struct alignas(kAlign) WorkerControl {
  // Written by the worker as it moves from phase to phase (relaxed); read by the
  // parent to name the phase in an error.
  std::atomic<std::uint32_t> phase;
  // The command_seq this worker last completed; stored (release) just before it
  // decrements `reduced`. The parent compares it to name late workers.
  std::atomic<std::uint32_t> done_seq;
  // Written before the worker decrements `computed`; read by the other workers
  // (the closer) before they take the last one, and by the parent after
  // `reduced` reached 0.
  std::uint32_t status;        // a SlotStatus
  std::uint32_t failed_phase;  // the Phase a failure happened in
  std::int32_t bad_param;      // kNonFinite: index of the first non-finite parameter
  std::int32_t pid;
  // With early buckets, written before the first bucket line is taken too:
  // the parent weighs the slot by it when it sums an early bucket.
  std::int64_t samples;
  double loss;
  PhaseTimes times;
  // NUL-terminated message when status == kFailed (the worker's exception).
  char message[kMessageBytes];
  // Written with `samples`: how many micro-batches had samples (equal
  // weighting with accumulation divides the slot by it).
  std::int32_t micro_count;
  // Written before the worker arrives on `computed`: ShardResult::metrics,
  // summed over the micro-batches, in name order (none when it had 0 samples).
  std::uint32_t metric_count;
  MetricEntry metrics[ShardResult::kMaxMetrics];
  // Written by the worker's SIGSEGV handler just before it dies: the offset in
  // the snapshot (the parameters, read-only in workers) of a write that
  // faulted, or -1. Read by the parent after the worker died.
  std::atomic<std::int64_t> fault_offset;
};

// Slot r's weights in the step (step/weights.h), one per worker after the
// controls. Written by the closer before it takes the last one from
// `computed` (0 when the step failed); read by the workers after `computed`
// read 0 and by the parent after `reduced` read 0.
struct SlotWeight {
  double weight;  // w_r: its share of the mean loss, buffers and gradient
  double factor;  // what the reduction multiplies slot r's gradient by
};

static_assert(std::atomic<std::uint32_t>::is_always_lock_free);
static_assert(std::atomic<std::int64_t>::is_always_lock_free, "written from a signal handler");
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t),
              "futex words must be plain 32-bit integers");
static_assert(sizeof(Header) % kAlign == 0 && sizeof(WorkerControl) % kAlign == 0);
static_assert(offsetof(Header, magic) == 0);
static_assert(offsetof(WorkerControl, message) == 96 && sizeof(SlotWeight) == 16);

// Typed access to the regions of a mapped segment: every use site names the
// region it wants, no offset arithmetic is written outside this struct.
struct SegmentMap {
  std::byte* base = nullptr;
  Layout layout;

  int workers() const { return static_cast<int>(layout.sizes.workers); }
  Header& header() const { return *reinterpret_cast<Header*>(base); }
  WorkerControl& control(int rank) const {
    return reinterpret_cast<WorkerControl*>(base + layout.control_offset)[rank];
  }
  SlotWeight* weights() const {
    return reinterpret_cast<SlotWeight*>(base + layout.weights_offset);
  }
  std::byte* message() const { return base + layout.message_offset; }
  std::byte* snapshotParams() const { return base + layout.snapshot_offset; }
  std::byte* snapshotBuffers() const { return base + layout.snapshot_buffers_offset; }
  std::size_t snapshotBytes() const { return layout.sizes.param_bytes + layout.sizes.buffer_bytes; }
  std::byte* result(int index) const { return base + layout.result_offset[index & 1]; }
  std::byte* tail(int index) const { return result(index) + layout.sizes.param_bytes; }
  std::byte* slot(int rank) const { return base + layout.slotOffset(rank); }  // its gradient
  std::uint8_t* slotFlags(int rank) const {
    return reinterpret_cast<std::uint8_t*>(slot(rank) + layout.slot_flags_offset);
  }
  std::uint8_t* slotRows(int rank) const {
    return reinterpret_cast<std::uint8_t*>(slot(rank) + layout.slot_rows_offset);
  }
  std::byte* slotBuffers(int rank) const { return slot(rank) + layout.slot_buffers_offset; }
};

// The two results: .grad views one (`viewed`), a step fills the other.
struct ResultPair {
  int viewed = 1;
  int fresh() const { return 1 - viewed; }
  void flip() { viewed = fresh(); }
};

// Checks what a process finds at the start of a mapping of `mapping_bytes`:
// magic, version, header size, that the stored offsets are exactly those plan()
// derives from the stored sizes and all lie inside the mapping, and, when
// `expected` is given (a worker knows its parent's layout), that they are that.
// Returns an empty string when valid, otherwise what is wrong.
std::string validateHeader(const void* base, std::size_t mapping_bytes,
                           const Layout* expected = nullptr);

// Writes the identity part of a header at `base` (zero-filled memory).
void initHeader(void* base, const Layout& layout, std::size_t page_bytes);

}  // namespace gradagg::detail
