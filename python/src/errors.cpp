#include "errors.h"

#include <gradagg/checkpoint.h>
#include <gradagg/errors.h>

namespace py = pybind11;

namespace gradagg::python {

namespace {

// Text from C++ as a Python str, invalid UTF-8 replaced rather than raising
// UnicodeDecodeError in place of the error it describes.
py::str text(const std::string& s) {
  return py::reinterpret_steal<py::str>(
      PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace"));
}

// Sets the Python error to errors.<name>(*args); the classes live as long as the module.
template <class... Args>
void raise(const char* name, Args&&... args) {
  // Leaked on purpose: nothing to release after the interpreter is gone.
  static const auto* errors = new py::module_(py::module_::import("gradagg.errors"));
  const py::object cls = errors->attr(name);
  const py::object instance = cls(std::forward<Args>(args)...);
  PyErr_SetObject(cls.ptr(), instance.ptr());
}

}  // namespace

void registerErrors() {
  py::module_::import("gradagg.errors");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const NonFiniteGradient& e) {
      raise("NonFiniteGradient", text(e.what()), e.rank(), phaseName(e.phase()), text(e.message()),
            e.parameter());
    } catch (const WorkerFailed& e) {
      raise("WorkerFailed", text(e.what()), e.rank(), phaseName(e.phase()), text(e.message()));
    } catch (const WorkerDied& e) {
      raise("WorkerDied", text(e.what()), e.rank(), phaseName(e.phase()), e.exitStatus(),
            e.signal());
    } catch (const StepTimeout& e) {
      raise("StepTimeout", text(e.what()), e.rank(), phaseName(e.phase()));
    } catch (const NodeFailed& e) {
      raise("NodeFailed", text(e.what()), e.node());
    } catch (const InvalidArgument& e) {
      raise("InvalidArgument", text(e.what()));
    } catch (const CheckpointError& e) {
      raise("CheckpointError", text(e.what()), e.path());
    } catch (const FileError& e) {
      raise("FileError", text(e.what()), e.path());
    } catch (const NotUsable& e) {
      raise("NotUsable", text(e.what()));
    } catch (const InternalError& e) {
      raise("InternalError", text(e.what()));
    } catch (const Error& e) {
      raise("Error", text(e.what()));
    }
  });
}

}  // namespace gradagg::python
