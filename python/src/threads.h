// Python objects and threads that C++ code touches: GilHeld keeps a Python
// object that C++ may copy and drop without holding the GIL, and a worker's
// thread gets its Python thread state once.
#pragma once

#include <memory>
#include <utility>

#include <pybind11/pybind11.h>

namespace gradagg::python {

// Python objects that C++ may copy and drop without holding the GIL.
template <class T>
class GilHeld {
 public:
  explicit GilHeld(T value)
      : p_(new T(std::move(value)), [](T* x) {
          pybind11::gil_scoped_acquire gil;
          delete x;
        }) {}
  const T& operator*() const { return *p_; }
  const T* operator->() const { return p_.get(); }

 private:
  std::shared_ptr<T> p_;
};
using PyRef = GilHeld<pybind11::object>;

// A worker's own thread (runtime/process.cpp) has no Python thread state: give it
// one for its whole life, so each step's GIL acquisition does not create and
// destroy one.
inline void ensureThreadState() {
  if (PyGILState_GetThisThreadState() != nullptr) return;
  PyGILState_Ensure();  // never released: the state lives as long as the thread
  PyEval_SaveThread();
}

}  // namespace gradagg::python
