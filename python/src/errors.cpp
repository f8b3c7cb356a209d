#include "errors.h"

#include <gradagg/checkpoint.h>
#include <gradagg/errors.h>

namespace py = pybind11;

namespace gradagg::python {

namespace {

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
      raise("NonFiniteGradient", e.what(), e.rank(), phaseName(e.phase()), e.message(),
            e.parameter());
    } catch (const WorkerFailed& e) {
      raise("WorkerFailed", e.what(), e.rank(), phaseName(e.phase()), e.message());
    } catch (const WorkerDied& e) {
      raise("WorkerDied", e.what(), e.rank(), phaseName(e.phase()), e.exitStatus(), e.signal());
    } catch (const StepTimeout& e) {
      raise("StepTimeout", e.what(), e.rank(), phaseName(e.phase()));
    } catch (const NodeFailed& e) {
      raise("NodeFailed", e.what(), e.node());
    } catch (const InvalidArgument& e) {
      raise("InvalidArgument", e.what());
    } catch (const CheckpointError& e) {
      raise("CheckpointError", e.what(), e.path());
    } catch (const FileError& e) {
      raise("FileError", e.what(), e.path());
    } catch (const NotUsable& e) {
      raise("NotUsable", e.what());
    } catch (const InternalError& e) {
      raise("InternalError", e.what());
    } catch (const Error& e) {
      raise("Error", e.what());
    }
  });
}

}  // namespace gradagg::python
