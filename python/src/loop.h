// The user's loop, for Python: BatchPosition (where a step is in its data),
// worker_seed (the seed each worker draws with) and _StopSignals (SIGINT,
// SIGTERM and SIGHUP as a request to stop after the step; gradagg/__init__.py
// makes it gradagg.StopSignals, a context manager).
#pragma once

#include <pybind11/pybind11.h>

namespace gradagg::python {

// Once, at import, before anything that takes or returns a BatchPosition.
void bindLoop(pybind11::module_& m);

}  // namespace gradagg::python
