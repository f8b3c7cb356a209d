// The checkpoint envelope of src/checkpoint/durable_file.h for Python: the
// private functions that gradagg/checkpoint.py builds gradagg.Checkpoint on.
#pragma once

#include <pybind11/pybind11.h>

namespace gradagg::python {

// _check_writable, _write_durably and _read_verified on `m` (the GIL released
// around the file I/O; a failure is gradagg.CheckpointError naming the file).
void bindDurable(pybind11::module_& m);

}  // namespace gradagg::python
