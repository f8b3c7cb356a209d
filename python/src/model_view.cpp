// A Python torch.nn.Module as a ModelView: its named parameters and buffers,
// the parameter list each step (Options::check_parameter_list) and its
// train/eval switch.
#include "model_view.h"

#include <torch/csrc/autograd/python_variable.h>

#include <fmt/format.h>

#include <gradagg/errors.h>

#include "threads.h"

namespace py = pybind11;

namespace gradagg::python {

namespace {

at::Tensor tensorOf(py::handle obj, const std::string& what) {
  if (!THPVariable_Check(obj.ptr()))
    throw InvalidArgument(fmt::format("{}: expected a torch.Tensor, got {}", what,
                                      std::string(py::str(py::type::of(obj).attr("__name__")))));
  return THPVariable_Unpack(obj.ptr());
}

std::vector<NamedTensor> namedTensors(const py::iterable& items, const char* kind) {
  std::vector<NamedTensor> out;
  for (py::handle item : items) {
    const auto pair = item.cast<py::tuple>();
    if (pair.size() != 2)
      throw InvalidArgument(fmt::format("{}: expected (name, tensor) pairs", kind));
    const auto name = pair[0].cast<std::string>();
    out.push_back({name, tensorOf(pair[1], fmt::format("{} '{}'", kind, name))});
  }
  return out;
}

// The model's parameter list, read each step for Options::check_parameter_list
// without Python's generators: the values of each module's `_parameters` dict,
// the modules as they were at construction. When a module's children changed
// (a submodule replaced or added) or a module is not a plain nn.Module
// (TorchScript), model.parameters() itself, which then differs from the list
// at construction where it matters.
class ParameterList {
 public:
  explicit ParameterList(const py::object& model) : model_(model) {
    for (py::handle m : model.attr("modules")()) {
      Module entry{py::reinterpret_borrow<py::object>(m), {}};
      const py::object children = entry.module.attr("_modules");
      if (!PyDict_Check(children.ptr()) || !PyDict_Check(entry.module.attr("_parameters").ptr())) {
        modules_.clear();  // not nn.Module's layout: ask the model each time
        return;
      }
      for (py::handle child : children.cast<py::dict>().attr("values")())
        entry.children.push_back(child.ptr());
      modules_.push_back(std::move(entry));
    }
  }

  std::vector<at::Tensor> now() const {
    std::vector<at::Tensor> list;
    if (!modules_.empty() && fromModules(list)) return list;
    list.clear();
    for (py::handle p : model_.attr("parameters")()) list.push_back(THPVariable_Unpack(p.ptr()));
    return list;
  }

 private:
  struct Module {
    py::object module;
    std::vector<PyObject*> children;  // compared by identity only, never dereferenced
  };

  bool fromModules(std::vector<at::Tensor>& list) const {
    for (const Module& m : modules_) {
      const py::object children = m.module.attr("_modules");
      const py::object params = m.module.attr("_parameters");
      if (!PyDict_Check(children.ptr()) || !PyDict_Check(params.ptr())) return false;
      if (static_cast<std::size_t>(PyDict_Size(children.ptr())) != m.children.size()) return false;
      Py_ssize_t pos = 0, k = 0;
      PyObject *key, *value;
      while (PyDict_Next(children.ptr(), &pos, &key, &value))
        if (value != m.children[k++]) return false;
      pos = 0;
      while (PyDict_Next(params.ptr(), &pos, &key, &value)) {
        if (value == Py_None) continue;
        if (!THPVariable_Check(value)) return false;
        list.push_back(THPVariable_Unpack(value));
      }
    }
    return true;
  }

  py::object model_;
  std::vector<Module> modules_;
};

}  // namespace

ModelView viewOfPython(const py::object& model) {
  ModelView view;
  view.parameters = namedTensors(model.attr("named_parameters")(), "parameter");
  view.buffers = namedTensors(model.attr("named_buffers")(), "buffer");
  const PyRef m(model);
  const GilHeld<ParameterList> parameters{ParameterList(model)};
  view.current_parameters = [parameters] {
    py::gil_scoped_acquire gil;
    return parameters->now();
  };
  view.is_training = [m] {
    py::gil_scoped_acquire gil;
    return (*m).attr("training").cast<bool>();
  };
  view.set_training = [m](bool on) {
    ensureThreadState();
    py::gil_scoped_acquire gil;
    (*m).attr("train")(on);
  };
  return view;
}

}  // namespace gradagg::python
