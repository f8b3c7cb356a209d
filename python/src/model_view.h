// A Python torch.nn.Module (or ScriptModule) as the ModelView an Aggregator or
// a Population binds.
#pragma once

#include <pybind11/pybind11.h>

#include <gradagg/model.h>

namespace gradagg::python {

// model.named_parameters(), model.named_buffers(), the parameter list each
// step for the check, model.training and model.train(mode). The view keeps
// model alive.
ModelView viewOfPython(const pybind11::object& model);

}  // namespace gradagg::python
