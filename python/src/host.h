// Python's side of gradagg's forks and waits (runtime/host_hooks.h): the GIL,
// os.register_at_fork handlers, sys.stdout's buffer, Ctrl-C.
#pragma once

namespace gradagg::python {

// Once, at import.
void installHostHooks();

// Thrown out of a wait when a signal handler raised (KeyboardInterrupt): the
// Python exception is set in the waiting thread's state. Once the GIL is held
// again, `throw pybind11::error_already_set()` raises it (see withoutGil).
struct Interrupted {};

}  // namespace gradagg::python
