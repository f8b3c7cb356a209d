// A Python shard function as a ShardFn, and a step's message between Python
// and C++: what the shard function may return (loss | (loss, samples) |
// (loss, samples, metrics)), each wrong shape told what was expected, and its
// exceptions as the worker's message, traceback included.
#include "shard.h"

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

#include <torch/csrc/autograd/python_variable.h>

#include <fmt/format.h>

#include <gradagg/errors.h>

#include "ints.h"
#include "runtime/utf8.h"
#include "threads.h"

namespace py = pybind11;

namespace gradagg::python {

std::string typeName(py::handle obj) { return py::str(py::type::of(obj).attr("__name__")); }

std::string describePythonError(py::error_already_set& e) {
  static constexpr std::size_t kRoom = 1000;
  std::string head = e.what();
  std::string trace;
  try {
    const py::object format = py::module_::import("traceback").attr("format_exception");
    for (py::handle line : format(e.type(), e.value(), e.trace())) trace += py::str(line);
  } catch (const py::error_already_set&) {
  }
  const auto first_newline = head.find('\n');
  if (first_newline != std::string::npos) head.resize(first_newline);
  if (head.size() + 1 + trace.size() <= kRoom) return head + "\n" + trace;
  // The exception's line (at most half the room), then the end of the
  // traceback, each cut between UTF-8 characters.
  if (head.size() > kRoom / 2)
    head = head.substr(0, detail::utf8PrefixBytes(head, kRoom / 2 - 3)) + "...";
  const std::size_t room = kRoom - head.size() - 5;  // "\n...\n"
  const std::size_t from =
      detail::utf8SuffixStart(trace, trace.size() > room ? trace.size() - room : 0);
  return head + "\n...\n" + trace.substr(from);
}

namespace {

// {"correct": 12, "tokens": 3.5}: str -> int or float.
std::map<std::string, double> metricsOf(py::handle obj) {
  if (!py::isinstance<py::dict>(obj))
    throw std::invalid_argument(fmt::format(
        "the shard function's third value must be a dict of metrics (str -> number), got {}",
        typeName(obj)));
  std::map<std::string, double> out;
  for (auto [key, value] : obj.cast<py::dict>()) {
    if (!py::isinstance<py::str>(key))
      throw std::invalid_argument(fmt::format("metric names must be str, got {}", typeName(key)));
    const auto name = key.cast<std::string>();
    if (THPVariable_Check(value.ptr())) {
      const at::Tensor t = THPVariable_Unpack(value.ptr());
      if (t.numel() != 1)
        throw std::invalid_argument(
            fmt::format("metric '{}' must be a number, got a tensor of "
                        "{} elements",
                        name, t.numel()));
      out[name] = t.item<double>();
    } else if (py::isinstance<py::int_>(value) || py::isinstance<py::float_>(value)) {
      out[name] = value.cast<double>();
    } else {
      throw std::invalid_argument(
          fmt::format("metric '{}' must be a number, got {}", name, typeName(value)));
    }
  }
  return out;
}

// loss | (loss, samples) | (loss, samples, metrics); loss may be None with 0 samples.
ShardResult toShardResult(const py::object& r) {
  if (THPVariable_Check(r.ptr())) return ShardResult{THPVariable_Unpack(r.ptr()), 1, {}};
  const bool sequence = py::isinstance<py::tuple>(r) || py::isinstance<py::list>(r);
  const auto seq = sequence ? r.cast<py::sequence>() : py::sequence();
  if (sequence && (seq.size() == 2 || seq.size() == 3) && py::isinstance<py::int_>(seq[1]) &&
      !py::isinstance<py::bool_>(seq[1])) {
    ShardResult out;
    out.samples = seq[1].cast<std::int64_t>();
    if (THPVariable_Check(seq[0].ptr()))
      out.loss = THPVariable_Unpack(seq[0].ptr());
    else if (!seq[0].is_none() || out.samples != 0)
      throw std::invalid_argument(fmt::format(
          "the shard function returned ({}, int); the loss must be a torch.Tensor that requires "
          "grad (not a Python number: did you call .item()?), or None with 0 samples",
          typeName(seq[0])));
    if (seq.size() == 3) out.metrics = metricsOf(seq[2]);
    return out;
  }
  if (py::isinstance<py::float_>(r) || py::isinstance<py::int_>(r))
    throw std::invalid_argument(fmt::format(
        "the shard function returned {}; the loss must be a torch.Tensor that requires grad "
        "(not a Python number: did you call .item()?)",
        typeName(r)));
  throw std::invalid_argument(fmt::format(
      "the shard function returned {}; expected a loss tensor, a (loss, samples) pair or a "
      "(loss, samples, metrics dict) triple",
      typeName(r)));
}

}  // namespace

// A step's message: {name: tensor, int or float}.
Message messageOf(const py::dict& d) {
  Message m;
  for (auto [key, value] : d) {
    if (!py::isinstance<py::str>(key))
      throw InvalidArgument(fmt::format("message: names must be str, got {}", typeName(key)));
    const auto name = key.cast<std::string>();
    if (THPVariable_Check(value.ptr()))
      m.set(name, THPVariable_Unpack(value.ptr()));
    else if (py::isinstance<py::bool_>(value) || py::isinstance<py::int_>(value))
      m.set(name, checkedInt<std::int64_t>(value, fmt::format("message '{}'", name)));
    else if (py::isinstance<py::float_>(value))
      m.set(name, value.cast<double>());
    else
      throw InvalidArgument(fmt::format(
          "message '{}': expected a torch.Tensor, int or float, got {}", name, typeName(value)));
  }
  return m;
}

// ctx.message as a dict: tensors (read-only views: clone() to keep or change
// one), and numbers as Python ints and floats.
py::dict messageDict(const Message& m) {
  py::dict d;
  for (const Message::Entry& e : m.entries()) {
    if (e.number && e.tensor.scalar_type() == at::kLong)
      d[py::str(e.name)] = e.tensor.item<std::int64_t>();
    else if (e.number)
      d[py::str(e.name)] = e.tensor.item<double>();
    else
      d[py::str(e.name)] = py::reinterpret_steal<py::object>(THPVariable_Wrap(e.tensor));
  }
  return d;
}

namespace {
bool g_in_shard = false;  // read and written with the GIL held

struct InShard {
  InShard() { g_in_shard = true; }
  ~InShard() { g_in_shard = false; }
};
}  // namespace

bool inShardFunction() { return g_in_shard; }

ShardFn shardOfPython(py::object fn) {
  if (!PyCallable_Check(fn.ptr()))
    throw InvalidArgument("shard: expected a callable taking a ShardContext");
  const PyRef f(std::move(fn));
  return [f](const ShardContext& ctx) {
    ensureThreadState();
    py::gil_scoped_acquire gil;
    const InShard in_shard;
    try {
      return toShardResult((*f)(ctx));
    } catch (py::error_already_set& e) {
      throw std::runtime_error(describePythonError(e));
    }
  };
}

}  // namespace gradagg::python
