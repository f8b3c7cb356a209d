// gradagg::Population for Python (population.cpp): DecisionRng, Policy,
// MemberContext, CopyEvent, MemberSnapshot and _Population.
#pragma once

#include <pybind11/pybind11.h>

namespace gradagg::python {

// Once, at import.
void bindPopulation(pybind11::module_& m);

}  // namespace gradagg::python
