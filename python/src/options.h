// gradagg::Options and gradagg::NodeOptions for Python, with Python's types
// (seconds, strings for the enums), bound from one table per struct (options.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace gradagg::python {

// Once, at import, before anything that takes or returns an Options.
void bindOptions(pybind11::module_& m);

}  // namespace gradagg::python
