// The fork, from Python's point of view:
//   parent: take the GIL (the caller released it for the whole construction),
//           flush sys.stdout and sys.stderr (a worker must not print the
//           parent's buffered text a second time), PyOS_BeforeFork (the
//           os.register_at_fork "before" handlers, the import lock), fork(),
//           PyOS_AfterFork_Parent, give the GIL back;
//   child:  PyOS_AfterFork_Child first (this thread owns the GIL, the other
//           Python threads are gone, the "child" handlers run), then release
//           the GIL: the worker runs on a fresh thread (runtime/process.cpp) that
//           takes it only to call the shard function and the train/eval switch;
//           before _exit, flush sys.stdout and sys.stderr once (what the worker
//           printed). _exit: the parent's atexit handlers never run in a worker.
// The wait: the parent waits for its workers with the GIL released (other
// Python threads run); every slice of a long wait it takes the GIL and runs the
// pending signal handlers, so Ctrl-C raises KeyboardInterrupt there, after the
// control channel has stopped and reaped the workers.
#include "host.h"

#include <Python.h>
#include <signal.h>

#include <gradagg/interrupt.h>

#include "runtime/host_hooks.h"
#include "runtime/stop_signals.h"

namespace gradagg::python {

namespace {

PyGILState_STATE fork_gil;  // the parent's GIL state across fork(); one fork at a time

// sys.stdout / sys.stderr flush(); errors ignored (a closed or replaced stream).
void flushStdStreams() {
  for (const char* name : {"stdout", "stderr"}) {
    PyObject* stream = PySys_GetObject(name);  // borrowed
    if (stream == nullptr || stream == Py_None) continue;
    PyObject* r = PyObject_CallMethod(stream, "flush", nullptr);
    if (r == nullptr) PyErr_Clear();
    Py_XDECREF(r);
  }
}

// SIGINT's handler while this process waits on other nodes: interruptWaits(),
// then whatever was there before (Python's own, which raises
// KeyboardInterrupt on the main thread). Armed again as each such wait begins,
// since signal.signal() puts Python's handler back in its place.
struct sigaction g_previous_sigint {};

void onSigint(int signal, siginfo_t* info, void* context) {
  gradagg::interruptWaits();
  const struct sigaction& p = g_previous_sigint;
  if (p.sa_flags & SA_SIGINFO) {
    if (p.sa_sigaction != nullptr) p.sa_sigaction(signal, info, context);
  } else if (p.sa_handler != SIG_DFL && p.sa_handler != SIG_IGN && p.sa_handler != nullptr) {
    p.sa_handler(signal);
  }
}

void armSigint() {
  if (detail::stopSignalsOwnSigint()) return;  // gradagg.StopSignals: it ends the waits itself
  struct sigaction now {};
  if (::sigaction(SIGINT, nullptr, &now) != 0) return;
  if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == onSigint) return;  // armed
  if (!(now.sa_flags & SA_SIGINFO) && (now.sa_handler == SIG_DFL || now.sa_handler == SIG_IGN))
    return;  // the default ends the process anyway; an ignored one stays ignored
  g_previous_sigint = now;
  struct sigaction ours = now;
  ours.sa_flags = (now.sa_flags | SA_SIGINFO) & ~SA_RESETHAND;
  ours.sa_sigaction = onSigint;
  ::sigaction(SIGINT, &ours, nullptr);
}

}  // namespace

void installHostHooks() {
  detail::HostHooks hooks;
  hooks.before_fork = [] {
    fork_gil = PyGILState_Ensure();
    flushStdStreams();
    PyOS_BeforeFork();
  };
  hooks.after_fork_parent = [] {
    PyOS_AfterFork_Parent();
    PyGILState_Release(fork_gil);
  };
  hooks.after_fork_child = [] {
    PyOS_AfterFork_Child();
    PyEval_SaveThread();  // the worker's own thread takes the GIL when it needs it
  };
  hooks.before_child_exit = [] {
    const PyGILState_STATE s = PyGILState_Ensure();
    flushStdStreams();
    PyGILState_Release(s);
  };
  hooks.check_interrupt = [] {
    const PyGILState_STATE s = PyGILState_Ensure();
    const int r = PyErr_CheckSignals();  // runs the handlers; on the main thread only
    PyGILState_Release(s);
    // The Python exception stays set in this thread's state; the binding that
    // released the GIL throws error_already_set once it holds it again.
    if (r != 0) throw Interrupted{};
  };
  hooks.arm_interrupt = armSigint;
  detail::setHostHooks(std::move(hooks));
}

}  // namespace gradagg::python
