// The parent's share of the machine while an Aggregator lives.
//
// A step has two halves: inside step() the workers compute and the parent
// waits; between steps the workers wait and the parent runs the user's
// optimizer.step(). So the parent may use the cores the workers use, and its
// optimizer (Adam reads and writes ~7 times the parameters' bytes) should run
// on all of them with a heap that keeps its temporaries (runtime/heap.h).
// What the process had before comes back when the last holder ends.
#pragma once

#include "runtime/heap.h"

namespace gradagg::detail {

class ParentShare {
 public:
  ParentShare() = default;
  // threads > 0: LibTorch's intra-op threads and the BLAS's own pool
  // (gradagg/blas.h) get that many; < 0: every core this process may use
  // (availableCores()); 0 leaves both alone. keep_memory: KeptHeap.
  ParentShare(int threads, bool keep_memory);
  ParentShare(ParentShare&& o) noexcept;
  ParentShare& operator=(ParentShare&& o) noexcept;
  ParentShare(const ParentShare&) = delete;
  ParentShare& operator=(const ParentShare&) = delete;
  ~ParentShare() { restore(); }

 private:
  void restore() noexcept;
  int saved_threads_ = 0;       // at::get_num_threads() before, when changed
  int saved_blas_threads_ = 0;  // the BLAS pool's own count before, when it has one
  KeptHeap heap_;
};

}  // namespace gradagg::detail
