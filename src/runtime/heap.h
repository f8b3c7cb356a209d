// How a worker's heap treats the large temporaries of its steps.
//
// glibc's malloc serves an allocation at or above its mmap threshold (128 KiB
// at first) with a fresh mapping and unmaps it on free; the threshold then
// rises to the size of the largest chunk freed so far (at most 32 MiB), and the
// top of the heap is given back to the kernel past a trim threshold. So what a
// step pays depends on the process's history: a forward and backward whose
// activations and gradient temporaries are mapped, faulted in page by page and
// zeroed by the kernel every step runs up to 2x slower (a CNN on this machine:
// docs/benchmark.md, "Where a worker's time went"), and a child inherits
// whatever threshold its parent had reached at fork.
#pragma once

namespace gradagg::detail {

// The heap settings a worker gets with Options::keep_worker_memory: chunks up to
// 32 MiB come from the heap and stay there when freed, so the next step reuses
// them (M_MMAP_THRESHOLD 32 MiB, the most glibc accepts; M_TRIM_THRESHOLD
// effectively never). The process keeps its peak heap until it exits.
// Returns false where the C library has no such settings (not glibc) or refused them.
bool keepFreedMemory() noexcept;

}  // namespace gradagg::detail
