// A Python int as a C++ integer, checked: pybind11's own cast says "Unable to
// cast Python instance" (or a TypeError listing overloads) for an int out of
// the C++ type's range; this names the argument and the range instead.
#pragma once

#include <Python.h>

#include <limits>
#include <string>
#include <type_traits>

#include <pybind11/pybind11.h>

#include <fmt/format.h>

#include <gradagg/errors.h>

namespace gradagg::python {

// "[-2**31, 2**31)", "[0, 2**64)": the values an I holds.
template <class I>
std::string intRange() {
  constexpr int bits = std::numeric_limits<I>::digits;
  return std::is_signed_v<I> ? fmt::format("[-2**{}, 2**{})", bits, bits)
                             : fmt::format("[0, 2**{})", bits);
}

// value (an int, a bool or anything with __index__) as an I. Another type is a
// TypeError, an int out of I's range an InvalidArgument, each naming `name`.
template <class I>
I checkedInt(pybind11::handle value, const std::string& name) {
  static_assert(std::is_integral_v<I> && !std::is_same_v<I, bool>);
  PyObject* index = PyFloat_Check(value.ptr()) ? nullptr : PyNumber_Index(value.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    throw pybind11::type_error(
        fmt::format("{}: expected an int, got {}", name, Py_TYPE(value.ptr())->tp_name));
  }
  const auto i = pybind11::reinterpret_steal<pybind11::int_>(index);
  bool fits = false;
  I out{};
  if constexpr (std::is_signed_v<I>) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
    fits =
        overflow == 0 && v >= std::numeric_limits<I>::min() && v <= std::numeric_limits<I>::max();
    out = static_cast<I>(v);
  } else {
    const unsigned long long v = PyLong_AsUnsignedLongLong(i.ptr());
    if (PyErr_Occurred() != nullptr)
      PyErr_Clear();  // OverflowError: negative or too large
    else
      fits = v <= std::numeric_limits<I>::max();
    out = static_cast<I>(v);
  }
  if (!fits)
    throw InvalidArgument(fmt::format("{}: expected an int in {}, got {}", name, intRange<I>(),
                                      std::string(pybind11::repr(i))));
  return out;
}

}  // namespace gradagg::python
