#include "runtime/parent_share.h"

#include <utility>

#include <ATen/Parallel.h>

#include <gradagg/blas.h>
#include <gradagg/options.h>

namespace gradagg::detail {

ParentShare::ParentShare(int threads, bool keep_memory) : heap_(keep_memory) {
  if (threads < 0) threads = availableCores();
  if (threads == 0) return;
  saved_threads_ = at::get_num_threads();
  const BlasInfo blas = blasInfo();
  if (blas.threading == "pthreads" || blas.vendor == "mkl" || blas.vendor == "blis")
    saved_blas_threads_ = blas.threads;
  at::set_num_threads(threads);
  setBlasThreads(threads);
}

ParentShare::ParentShare(ParentShare&& o) noexcept
    : saved_threads_(std::exchange(o.saved_threads_, 0)),
      saved_blas_threads_(std::exchange(o.saved_blas_threads_, 0)),
      heap_(std::move(o.heap_)) {}

ParentShare& ParentShare::operator=(ParentShare&& o) noexcept {
  if (this != &o) {
    restore();
    saved_threads_ = std::exchange(o.saved_threads_, 0);
    saved_blas_threads_ = std::exchange(o.saved_blas_threads_, 0);
    heap_ = std::move(o.heap_);
  }
  return *this;
}

void ParentShare::restore() noexcept {
  if (saved_threads_ > 0) {
    try {
      at::set_num_threads(saved_threads_);
      setBlasThreads(saved_blas_threads_ > 0 ? saved_blas_threads_ : saved_threads_);
    } catch (...) {  // nothing to do about it in a destructor
    }
  }
  saved_threads_ = saved_blas_threads_ = 0;
  heap_ = KeptHeap();
}

}  // namespace gradagg::detail
