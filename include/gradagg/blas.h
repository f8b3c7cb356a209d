// Which BLAS LibTorch's CPU matrix products run on, and its threads.
//
// Debian's LibTorch calls the Fortran BLAS (sgemm_, dgemm_) of whatever
// libblas.so.3 the system provides: OpenBLAS, BLIS, MKL, or the reference
// netlib BLAS (one thread, textbook loops, 10-37x slower for the models in
// docs/benchmark.md). What a speed figure means depends on it, so gradagg
// names it, and a worker gives it the same thread count as LibTorch's
// intra-op pool (Options::threads_per_worker).
#pragma once

#include <string>

namespace gradagg {

struct BlasInfo {
  // The shared object whose gemm LibTorch's sgemm_ runs in this process, links
  // resolved: for OpenBLAS the library behind Debian's thin libblas.so.3 (e.g.
  // /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblasp-r0.3.21.so, or the
  // one another module such as numpy loaded first); "" where no sgemm_ is loaded.
  std::string library;
  // "openblas", "mkl", "blis", "reference" (netlib's, no vendor entry points)
  // or "unknown".
  std::string vendor;
  // How its gemm runs in parallel: "openmp" (follows at::set_num_threads),
  // "pthreads" (a pool of its own), "sequential" or "unknown".
  std::string threading;
  // The threads its next gemm may use in this process; 1 for a sequential or
  // reference BLAS, 0 where it cannot be asked.
  int threads = 0;
  // The vendor's own description (openblas_get_config(): version, kernel,
  // build options); "" where it has none.
  std::string config;

  // False for the reference BLAS: every figure measured on it is void.
  bool fast() const { return vendor != "reference" && !library.empty(); }
  // One line: "openblas (openmp, 2 threads) /usr/lib/.../libblas.so.3".
  std::string describe() const;
};

// Asks this process's dynamic linker and the BLAS itself; cheap after the first call.
BlasInfo blasInfo();

// Sets the threads of the BLAS's own pool where it has one (OpenBLAS built with
// pthreads or OpenMP, BLIS, MKL) to `threads` (>= 1); an OpenMP build follows
// at::set_num_threads as well. The Aggregator and the Population call it
// beside at::set_num_threads in every worker, and in the parent between
// steps; a program that sets threads itself calls both. Returns false where
// the BLAS has no such setting (the reference BLAS is always one thread).
bool setBlasThreads(int threads);

}  // namespace gradagg
