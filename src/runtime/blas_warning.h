// The one warning gradagg logs about the machine it runs on.
#pragma once

namespace gradagg::detail {

// Once per process, on stderr: LibTorch's gemm runs on the reference BLAS, and
// which package to install (include/gradagg/blas.h). A log line, never an
// error; GRADAGG_QUIET_BLAS set in the environment silences it.
void warnIfReferenceBlas() noexcept;

}  // namespace gradagg::detail
