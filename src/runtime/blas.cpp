// Finding LibTorch's BLAS: ask the dynamic linker which object LibTorch's
// sgemm_ binds to (from libtorch_cpu's own scope, so a Python process whose
// torch was loaded RTLD_LOCAL answers the same), then look for the vendors'
// entry points in that object. Nothing here links against a BLAS: every call
// goes through dlsym, so gradagg runs on whichever one the system provides.
#include <gradagg/blas.h>

#include <dlfcn.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include "runtime/blas_warning.h"

namespace gradagg {

namespace {

// The object holding LibTorch's sgemm_, and its handle (a reference of our
// own, never closed: the object stays loaded with LibTorch anyway).
struct Located {
  std::string path;
  void* handle = nullptr;
};

void* findSgemm() {
  // libtorch_cpu's scope: itself and its dependencies, in the order its own
  // references resolve (libblas.so.3 comes from there).
  for (const char* lib : {"libtorch_cpu.so", "libtorch_cpu.so.1.13", "libtorch.so"}) {
    if (void* h = ::dlopen(lib, RTLD_LAZY | RTLD_NOLOAD)) {
      void* f = ::dlsym(h, "sgemm_");
      ::dlclose(h);
      if (f) return f;
    }
  }
  return ::dlsym(RTLD_DEFAULT, "sgemm_");
}

// The file that defines `symbol`, links resolved; `otherwise` when unknown.
std::string definingObject(void* symbol, const std::string& otherwise) {
  Dl_info info{};
  if (!symbol || ::dladdr(symbol, &info) == 0 || !info.dli_fname) return otherwise;
  std::string path = info.dli_fname;
  if (char* real = ::realpath(info.dli_fname, nullptr)) {
    path = real;
    std::free(real);
  }
  return path;
}

Located locate() {
  Located where;
  void* f = findSgemm();
  Dl_info info{};
  if (!f || ::dladdr(f, &info) == 0 || !info.dli_fname) return where;
  where.path = definingObject(f, info.dli_fname);
  where.handle = ::dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  return where;
}

const Located& located() {
  static const Located where = locate();
  return where;
}

template <typename Fn>
Fn entry(const char* name) {
  void* h = located().handle;
  return h ? reinterpret_cast<Fn>(::dlsym(h, name)) : nullptr;
}

using GetInt = int (*)();
using SetInt = void (*)(int);
using GetText = char* (*)();
using GetConstText = const char* (*)();
using SetLong = void (*)(long);  // bli_thread_set_num_threads(dim_t)
using GetLong = long (*)();

}  // namespace

std::string BlasInfo::describe() const {
  if (library.empty()) return "no BLAS found (LibTorch's sgemm_ is not loaded)";
  std::string threads_text =
      threads > 0 ? fmt::format(", {} thread{}", threads, threads == 1 ? "" : "s") : "";
  return fmt::format("{} ({}{}) {}", vendor, threading, threads_text, library);
}

BlasInfo blasInfo() {
  BlasInfo b;
  const Located& where = located();
  b.library = where.path;
  if (b.library.empty()) {
    b.vendor = b.threading = "unknown";
    return b;
  }
  if (auto config = entry<GetText>("openblas_get_config")) {
    b.vendor = "openblas";
    b.config = config();
    // Debian's openblas-*/libblas.so.3 is a thin interface over libopenblas.so.0,
    // and the process may have loaded another build's libopenblas.so.0 first
    // (numpy does, through its own alternative): the work runs where the
    // vendor's entry points are, so that object is the one named.
    b.library = definingObject(reinterpret_cast<void*>(config), b.library);
    const auto parallel = entry<GetInt>("openblas_get_parallel");
    const int mode = parallel ? parallel() : -1;
    b.threading = mode == 0   ? "sequential"
                  : mode == 1 ? "pthreads"
                  : mode == 2 ? "openmp"
                              : "unknown";
    if (mode == 0) {
      b.threads = 1;
    } else if (mode == 2) {
      // The OpenMP build takes omp_get_max_threads() at each call, which is
      // LibTorch's intra-op setting (at::set_num_threads).
      b.threads = at::get_num_threads();
    } else if (auto get = entry<GetInt>("openblas_get_num_threads")) {
      b.threads = get();
    }
  } else if (auto mkl = entry<GetInt>("MKL_Get_Max_Threads")) {
    b.vendor = "mkl";
    b.threading = "unknown";
    b.threads = mkl();
  } else if (auto blis = entry<GetConstText>("bli_info_get_version_str")) {
    b.vendor = "blis";
    b.config = blis();
    b.threading = "unknown";
    if (auto get = entry<GetLong>("bli_thread_get_num_threads"))
      b.threads = static_cast<int>(get());
  } else if (b.library.find("libblas.so") != std::string::npos) {  // netlib's, no vendor entries
    b.vendor = "reference";
    b.threading = "sequential";
    b.threads = 1;
  } else {
    b.vendor = b.threading = "unknown";
  }
  return b;
}

bool setBlasThreads(int threads) {
  if (threads < 1) threads = 1;
  if (auto set = entry<SetInt>("openblas_set_num_threads")) {
    set(threads);
    return true;
  }
  if (auto set = entry<SetInt>("MKL_Set_Num_Threads")) {
    set(threads);
    return true;
  }
  if (auto set = entry<SetLong>("bli_thread_set_num_threads")) {
    set(threads);
    return true;
  }
  return false;
}

namespace detail {

void warnIfReferenceBlas() noexcept {
  static std::once_flag once;
  try {
    std::call_once(once, [] {
      if (std::getenv("GRADAGG_QUIET_BLAS")) return;
      const BlasInfo b = blasInfo();
      if (b.vendor != "reference") return;
      std::fprintf(stderr,
                   "gradagg: warning: LibTorch's matrix products run on the reference BLAS (%s): "
                   "one thread, 10-37x slower than OpenBLAS for the models of docs/benchmark.md; "
                   "install Debian's OpenBLAS (apt-get install libopenblas0-openmp)\n",
                   b.library.c_str());
    });
  } catch (...) {  // a log line, never an error
  }
}

}  // namespace detail

}  // namespace gradagg
