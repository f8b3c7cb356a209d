// Options and NodeOptions for Python, each bound from one table. A row names a
// field once: its keyword and attribute (the C++ field's name), its member
// pointer and how Python sees it: as it is (bool, str, dict, NodeOptions), as a
// range-checked int, as float seconds (a std::chrono::milliseconds), as a name of
// the enum's string table or as None or an int (an optional unsigned 64-bit
// number). From a table come the keyword-only constructor, whose defaults are the
// fields of a default-constructed struct, the read-write attributes and __repr__.
// A bad value is the InvalidArgument its conversion names (an int out of its C++
// type's range too), a wrong type a TypeError; the ranges are Options::validate's.
#include "options.h"

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <pybind11/stl.h>

#include <fmt/format.h>

#include <gradagg/errors.h>
#include <gradagg/options.h>

#include "ints.h"

namespace py = pybind11;

namespace gradagg::python {

namespace {

template <class E>
using EnumNames = std::initializer_list<std::pair<const char*, E>>;

const EnumNames<Weighting> kWeightings = {{"samples", Weighting::kBySamples},
                                          {"equal", Weighting::kEqual}};
const EnumNames<BufferSync> kBufferSyncs = {{"rank0", BufferSync::kFromRank0},
                                            {"mean", BufferSync::kMean},
                                            {"keep", BufferSync::kKeepParent}};
const EnumNames<NonFinitePolicy> kNonFinite = {{"raise", NonFinitePolicy::kRaise},
                                               {"skip", NonFinitePolicy::kSkipStep}};
const EnumNames<Compression> kCompressions = {{"none", Compression::kNone},
                                              {"bf16", Compression::kBFloat16}};

// A field as Python has it: the value itself.
template <class V>
struct AsIs {
  using Py = V;
  Py toPy(const V& v) const { return v; }
  V fromPy(Py v, const char* /*name*/) const { return v; }
};

// An integer as a Python int: one outside the C++ type's range is an
// InvalidArgument naming prefix + the field and the range (checkedInt), another
// type a TypeError; the field's own limits are Options::validate's.
template <class V>
struct AsInt {
  using Py = py::object;
  const char* prefix;

  Py toPy(V v) const { return py::int_(v); }
  V fromPy(const py::object& value, const char* name) const {
    return checkedInt<V>(value, std::string(prefix) + name);
  }
};

// A duration as float seconds: > 0 and at most 1e9, else InvalidArgument naming
// prefix + the field; truncated to whole milliseconds.
struct AsSeconds {
  using Py = double;
  using Seconds = std::chrono::duration<double>;
  const char* prefix;

  Py toPy(std::chrono::milliseconds ms) const { return Seconds(ms).count(); }
  std::chrono::milliseconds fromPy(double seconds, const char* name) const {
    if (!(seconds > 0) || seconds > 1e9)
      throw InvalidArgument(
          fmt::format("{}{}: expected seconds > 0, got {}", prefix, name, seconds));
    return std::chrono::duration_cast<std::chrono::milliseconds>(Seconds(seconds));
  }
};

// An enum as one of its names; another string is an InvalidArgument naming
// prefix + the field and every name.
template <class E>
struct AsName {
  using Py = std::string;
  const EnumNames<E>* names;
  const char* prefix;

  Py toPy(E e) const {
    for (const auto& [name, v] : *names)
      if (v == e) return name;
    return "?";
  }
  E fromPy(const std::string& value, const char* name) const {
    std::string expected;
    for (const auto& [n, e] : *names) {
      if (value == n) return e;
      expected += fmt::format("{}'{}'", expected.empty() ? "" : ", ", n);
    }
    throw InvalidArgument(
        fmt::format("{}{}: expected one of {}, got '{}'", prefix, name, expected, value));
  }
};

// An optional unsigned 64-bit number (the seed) as None or an int; another
// int or type is an InvalidArgument naming the field.
struct AsOptionalUint64 {
  using Py = py::object;
  Py toPy(const std::optional<std::uint64_t>& v) const {
    return v ? py::object(py::int_(*v)) : py::object(py::none());
  }
  std::optional<std::uint64_t> fromPy(const py::object& value, const char* name) const {
    if (value.is_none()) return std::nullopt;
    if (py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value)) {
      const py::int_ zero(0),
          top(py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(~0ULL)));
      if (!(value < zero) && !(value > top)) return value.cast<std::uint64_t>();
    }
    throw InvalidArgument(fmt::format("{}: expected None or an int in [0, 2**64), got {}", name,
                                      std::string(py::repr(value))));
  }
};

// A secret (the job token): read and written as the string it is, but __repr__
// shows only whether it is set, so printing the options, or a log or traceback
// that shows them, does not write the secret out.
struct AsSecret {
  using Py = std::string;
  Py toPy(const std::string& v) const { return v; }
  std::string fromPy(std::string v, const char* /*name*/) const { return v; }
  static std::string shown(const std::string& v) { return v.empty() ? "''" : "'<set>'"; }
};

AsSeconds asSeconds(const char* prefix = "") { return {prefix}; }

template <class E>
AsName<E> asName(const EnumNames<E>& names, const char* prefix = "") {
  return {&names, prefix};
}

// One row of a table: the field `name` of T, of type V, seen through Conv.
template <class T, class V, class Conv>
struct Field {
  using Py = typename Conv::Py;
  const char* name;
  V T::*member;
  Conv conv;
  const char* doc;  // the attribute's docstring, or nullptr

  Py get(const T& o) const { return conv.toPy(o.*member); }
  void set(T& o, Py value) const { o.*member = conv.fromPy(std::move(value), name); }
  // What __repr__ shows: repr() of the Python value, or a secret's stand-in.
  std::string shown(const T& o) const {
    if constexpr (std::is_same_v<Conv, AsSecret>)
      return AsSecret::shown(o.*member);
    else if constexpr (std::is_same_v<Py, py::object>)
      return std::string(py::repr(get(o)));
    else
      return std::string(py::repr(py::cast(get(o))));
  }

  // As it is: def_readwrite's, whose NodeOptions is the Options' own (o.nodes.x = v sets it).
  void bindAttribute(py::class_<T>& c) const {
    if constexpr (std::is_same_v<Conv, AsIs<V>>) {
      c.def_readwrite(name, member, doc);
    } else {
      const Field f = *this;
      c.def_property(
          name, [f](const T& o) { return f.get(o); },
          [f](T& o, Py value) { f.set(o, std::move(value)); }, doc);
    }
  }
};

template <class T, class V>
Field<T, V, AsIs<V>> field(const char* name, V T::*member, const char* doc = nullptr) {
  return {name, member, {}, doc};
}
template <class T, class V, class Conv, class = typename Conv::Py>
Field<T, V, Conv> field(const char* name, V T::*member, Conv conv, const char* doc = nullptr) {
  return {name, member, conv, doc};
}

// In the header's order. The prefixes keep the names the messages have always
// had: "nodes.timeout", "NodeOptions.compression".
const std::tuple kNodeFields{
    field("nodes", &NodeOptions::nodes, AsInt<int>{"nodes."}),
    field("node_rank", &NodeOptions::node_rank, AsInt<int>{"nodes."}),
    field("master_addr", &NodeOptions::master_addr),
    field("master_port", &NodeOptions::master_port, AsInt<int>{"nodes."}),
    field("store_path", &NodeOptions::store_path),
    field("external_store", &NodeOptions::external_store,
          "the TCPStore is served by a launcher (torchrun's agent): node 0 connects too"),
    field("store_prefix", &NodeOptions::store_prefix),
    field("interface", &NodeOptions::interface),
    field("token", &NodeOptions::token, AsSecret{},
          "the job token: the nodes prove it to each other before anything crosses "
          "(repr shows only whether it is set)"),
    field("timeout", &NodeOptions::timeout, asSeconds("nodes.")),
    field("checksum_interval", &NodeOptions::checksum_interval, AsInt<int>{"nodes."}),
    field("compression", &NodeOptions::compression, asName(kCompressions, "NodeOptions."),
          "'bf16': float32 gradients cross the nodes as bf16 (off: 'none')"),
    field("bucket_bytes", &NodeOptions::bucket_bytes, AsInt<std::uint64_t>{"nodes."},
          "buckets the gradient crosses the nodes in (DDP's bucket_cap_mb)"),
    field("first_bucket_bytes", &NodeOptions::first_bucket_bytes, AsInt<std::uint64_t>{"nodes."},
          "the first bucket of each dtype (DDP's 1 MiB)"),
    field("overlap", &NodeOptions::overlap,
          "buckets start across the nodes while backward goes on"),
    field("resume_identity", &NodeOptions::resume_identity,
          "'' for a fresh start, else the identity of the checkpoint resumed from"),
    field("must_match", &NodeOptions::must_match,
          "settings (str -> str) every node must share, compared at the rendezvous"),
};

// In the header's order; gradagg/__init__.py sets them by these names.
const std::tuple kOptionFields{
    field("workers", &Options::workers, AsInt<int>{""}),
    field("weighting", &Options::weighting, asName(kWeightings)),
    field("buffers", &Options::buffers, asName(kBufferSyncs)),
    field("threads_per_worker", &Options::threads_per_worker, AsInt<int>{""}),
    field("parent_threads", &Options::parent_threads, AsInt<int>{""}),
    field("keep_worker_memory", &Options::keep_worker_memory,
          "Workers keep freed memory for the next step (glibc malloc settings)."),
    field("keep_parent_memory", &Options::keep_parent_memory,
          "The parent keeps freed memory for its next optimizer step while the aggregator "
          "lives (glibc malloc settings, restored after)."),
    field("step_timeout", &Options::step_timeout, asSeconds()),
    field("shutdown_timeout", &Options::shutdown_timeout, asSeconds()),
    field("accumulation_steps", &Options::accumulation_steps, AsInt<int>{""}),
    field("non_finite", &Options::non_finite, asName(kNonFinite)),
    field("max_consecutive_skips", &Options::max_consecutive_skips, AsInt<int>{""}),
    field("max_restarts", &Options::max_restarts, AsInt<int>{""}),
    field("nodes", &Options::nodes),
    field("seed_workers", &Options::seed_workers),
    field("seed", &Options::seed, AsOptionalUint64{},
          "The run's seed; None (the default): torch.initial_seed() when the Aggregator is "
          "made. Worker r draws with worker_seed(seed, r, step)."),
    field("check_parameter_list", &Options::check_parameter_list),
    field("start_step", &Options::start_step, AsInt<std::int64_t>{""},
          "The global step of the first step() (a resume: the checkpoint's step)."),
    field("message_bytes", &Options::message_bytes, AsInt<std::uint64_t>{""},
          "Room for a step's message, fixed at construction (64 KiB)."),
};

// T(*, <every field>=<T{}'s value>): T{} with each keyword set through its row.
template <class T, class... F>
void bindConstructor(py::class_<T>& c, const std::tuple<F...>& fields) {
  std::apply(
      [&c](const F&... f) {
        const T defaults{};
        c.def(py::init([f...](typename F::Py... values) {
                T o;
                (f.set(o, std::move(values)), ...);
                return o;
              }),
              py::kw_only(), py::arg_v(f.name, f.get(defaults))...);
      },
      fields);
}

// "T(field=repr(value), ...)", every field in the table's order.
template <class T, class... F>
void bindRepr(py::class_<T>& c, const std::tuple<F...>& fields) {
  const auto type = c.attr("__name__").template cast<std::string>();
  c.def("__repr__", [type, fields](const T& o) {
    std::string text;
    std::apply(
        [&](const F&... f) {
          ((text += fmt::format("{}{}={}", text.empty() ? "" : ", ", f.name, f.shown(o))), ...);
        },
        fields);
    return fmt::format("{}({})", type, text);
  });
}

template <class T, class... F>
void bindFields(py::class_<T>& c, const std::tuple<F...>& fields) {
  bindConstructor(c, fields);
  std::apply([&c](const F&... f) { (f.bindAttribute(c), ...); }, fields);
  bindRepr(c, fields);
}

}  // namespace

void bindOptions(py::module_& m) {
  py::class_<NodeOptions> nodes(m, "NodeOptions",
                                "Several machines: see gradagg::NodeOptions (docs/multinode.md).");
  bindFields(nodes, kNodeFields);
  nodes.def_static(
      "from_environment", [] { return NodeOptions::fromEnvironment(); },
      "The defaults overridden by GRADAGG_NNODES, GRADAGG_NODE_RANK, MASTER_ADDR, "
      "MASTER_PORT, GRADAGG_STORE_PATH, GRADAGG_SOCKET_IFNAME, GRADAGG_NODE_TIMEOUT_MS, "
      "GRADAGG_CHECKSUM_INTERVAL.");

  py::class_<Options> options(m, "Options",
                              "gradagg::Options with Python's types (see Aggregator).");
  bindFields(options, kOptionFields);
  options.def("validate", &Options::validate);
}

}  // namespace gradagg::python
