// How a process's heap treats the large temporaries of its steps.
//
// glibc's malloc serves an allocation at or above its mmap threshold (128 KiB
// at first) with a fresh mapping and unmaps it on free; the threshold then
// rises to the size of the largest chunk freed so far (at most 32 MiB), and the
// top of the heap is given back to the kernel past a trim threshold. So what a
// step pays depends on the process's history: a forward and backward whose
// activations and gradient temporaries are mapped, faulted in page by page and
// zeroed by the kernel every step runs up to 2x slower (a CNN on this machine:
// docs/benchmark.md, "Where a worker's time went"), and a child inherits
// whatever threshold its parent had reached at fork. The parent's optimizer
// step pays the same: torch::optim::Adam on 5.8M parameters maps and faults in
// its 23 MB temporaries every step (147 ms on one thread, 10.7 ms when the heap
// keeps them).
#pragma once

namespace gradagg::detail {

// The heap settings a worker gets with Options::keep_worker_memory (and the
// parent with keep_parent_memory): chunks up to 32 MiB come from the heap and
// stay there when freed, so the next step reuses them (M_MMAP_THRESHOLD 32 MiB,
// the most glibc accepts; M_TRIM_THRESHOLD effectively never). The process
// keeps its peak heap until it exits or restoreHeap() runs.
// Returns false where the C library has no such settings (not glibc) or refused them.
bool keepFreedMemory() noexcept;

// Back to the thresholds the process started with: those GLIBC_TUNABLES gives
// (glibc.malloc.mmap_threshold, glibc.malloc.trim_threshold), else glibc's
// 128 KiB each, and the heap's free top is given back (malloc_trim). glibc has
// no call that reads the thresholds, and setting one ends its dynamic mmap
// threshold for good: a process that called mallopt itself gets glibc's
// starting values back, not its own.
void restoreHeap() noexcept;

// keepFreedMemory() for the parent while at least one holder lives: the first
// holder changes the heap, the last one's end restores it.
class KeptHeap {
 public:
  KeptHeap() = default;
  explicit KeptHeap(bool keep);
  KeptHeap(KeptHeap&& o) noexcept : held_(o.held_) { o.held_ = false; }
  KeptHeap& operator=(KeptHeap&& o) noexcept;
  KeptHeap(const KeptHeap&) = delete;
  KeptHeap& operator=(const KeptHeap&) = delete;
  ~KeptHeap() { release(); }

 private:
  void release() noexcept;
  bool held_ = false;
};

}  // namespace gradagg::detail
