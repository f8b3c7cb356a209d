// Python's side of gradagg's forks and waits (runtime/host_hooks.h): the GIL,
// os.register_at_fork handlers, sys.stdout's buffer, Ctrl-C.
#pragma once

#include <Python.h>

#include <pybind11/pybind11.h>

#include <gradagg/errors.h>

namespace gradagg::python {

// Once, at import.
void installHostHooks();

// Thrown out of a wait when a signal handler raised (KeyboardInterrupt): the
// Python exception is set in the waiting thread's state. Once the GIL is held
// again, `throw pybind11::error_already_set()` raises it (see withoutGil).
struct Interrupted {};

// Runs f with the GIL released; a Ctrl-C seen while waiting (host.cpp) is raised
// as the Python exception its handler set, once the GIL is held again.
template <class F>
decltype(auto) withoutGil(F&& f) {
  try {
    pybind11::gil_scoped_release nogil;
    return f();
  } catch (const Interrupted&) {
    throw pybind11::error_already_set();
  } catch (const gradagg::Interrupted&) {
    // Ctrl-C ended a wait on other nodes: Python's handler runs now
    // (KeyboardInterrupt); a handler that raises nothing leaves NodeFailed.
    if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
    throw;
  }
}

}  // namespace gradagg::python
