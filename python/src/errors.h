// gradagg's C++ exceptions raised as the classes of gradagg/errors.py.
#pragma once

#include <pybind11/pybind11.h>

namespace gradagg::python {

// Once, at import (gradagg.errors must be importable).
void registerErrors();

}  // namespace gradagg::python
