// The user's loop, for Python: BatchPosition with Python's comparisons, hash,
// repr and pickling; worker_seed; and the C++ StopSignals, whose handlers are
// the C++ ones (async-signal-safe atomics), so Python's own SIGINT handler does
// not run while one lives: no KeyboardInterrupt in the middle of a step.
#include "loop.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include <gradagg/errors.h>
#include <gradagg/shard.h>
#include <gradagg/stop_signals.h>

namespace py = pybind11;
using namespace pybind11::literals;

namespace gradagg::python {

namespace {

// A StopSignals that close() ends (its handlers restored) before Python drops it.
class PyStopSignals {
 public:
  explicit PyStopSignals(double patience_seconds) {
    if (!(patience_seconds >= 0) || patience_seconds > 1e6)
      throw InvalidArgument(
          fmt::format("patience: expected seconds >= 0, got {}", patience_seconds));
    stop_ = std::make_unique<StopSignals>(
        std::chrono::milliseconds(static_cast<std::int64_t>(patience_seconds * 1000.0)));
  }
  StopSignals& get() const {
    if (!stop_) throw NotUsable("gradagg.StopSignals: closed (its handlers were restored)");
    return *stop_;
  }
  bool closed() const { return !stop_; }
  void close() { stop_.reset(); }

 private:
  std::unique_ptr<StopSignals> stop_;
};

// A StopSignals::Hold that Python ends with release() (or `with`).
class PyStopHold {
 public:
  explicit PyStopHold(StopSignals::Hold hold) : hold_(std::move(hold)) {}
  // A second stop signal that came during the hold kills the process here.
  void release() { hold_.reset(); }

 private:
  std::optional<StopSignals::Hold> hold_;
};

void bindBatchPosition(py::module_& m) {
  using P = BatchPosition;
  py::class_<P>(m, "BatchPosition",
                "Where a step is in its data: the epoch and the batch's index in it (what "
                "enumerate(loader) counts in one epoch of a DataLoader). "
                "ShardedBatches.steps(epoch) lists an epoch's positions, "
                "Aggregator.step(position) trains one, a checkpoint keeps the next "
                "(TrainingState.position).")
      .def(py::init<>())
      .def(py::init([](std::int64_t epoch, std::int64_t index) {
             return P{epoch, index};
           }),
           "epoch"_a = 0, "index"_a = 0)
      .def_readonly("epoch", &P::epoch)  // read-only: it is hashable, a value
      .def_readonly("index", &P::index, "the batch in the epoch, 0..steps_per_epoch - 1")
      .def("next", &P::next,
           "The position after this one's batch: (epoch, index + 1), in the same epoch.")
      .def(
          "__eq__", [](const P& a, const P& b) { return a == b; }, py::is_operator())
      .def(
          "__ne__", [](const P& a, const P& b) { return a != b; }, py::is_operator())
      .def(
          "__lt__", [](const P& a, const P& b) { return a < b; }, py::is_operator())
      .def(
          "__le__", [](const P& a, const P& b) { return !(b < a); }, py::is_operator())
      .def(
          "__gt__", [](const P& a, const P& b) { return b < a; }, py::is_operator())
      .def(
          "__ge__", [](const P& a, const P& b) { return !(a < b); }, py::is_operator())
      .def("__hash__", [](const P& p) { return py::hash(py::make_tuple(p.epoch, p.index)); })
      .def("__repr__",
           [](const P& p) {
             return fmt::format("BatchPosition(epoch={}, index={})", p.epoch, p.index);
           })
      .def(py::pickle([](const P& p) { return py::make_tuple(p.epoch, p.index); },
                      [](const py::tuple& t) {
                        if (t.size() != 2)
                          throw InvalidArgument("BatchPosition: expected (epoch, index)");
                        return P{t[0].cast<std::int64_t>(), t[1].cast<std::int64_t>()};
                      }));
}

void bindStopSignals(py::module_& m) {
  py::class_<PyStopHold>(m, "_StopHold")
      .def("release", &PyStopHold::release)
      .def(
          "__enter__", [](PyStopHold& h) -> PyStopHold& { return h; },
          py::return_value_policy::reference)
      .def("__exit__", [](PyStopHold& h, const py::args&) {
        h.release();
        return false;
      });
  py::class_<PyStopSignals>(m, "_StopSignals",
                            "gradagg::StopSignals (use gradagg.StopSignals): one at a time.")
      .def(py::init<double>(), "patience"_a)
      .def_property_readonly("requested",
                             [](const PyStopSignals& s) { return s.get().requested(); })
      .def_property_readonly("signal", [](const PyStopSignals& s) { return s.get().signal(); })
      .def_property_readonly("closed", &PyStopSignals::closed)
      .def("hold", [](const PyStopSignals& s) { return PyStopHold(s.get().hold()); })
      .def("close", &PyStopSignals::close);
}

}  // namespace

void bindLoop(py::module_& m) {
  bindBatchPosition(m);
  m.def(
      "worker_seed",
      [](const py::int_& seed, int global_rank, std::int64_t step) {
        const py::int_ zero(0),
            limit(py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(~0ULL)));
        if (seed < zero || seed > limit)
          throw InvalidArgument(fmt::format("seed: expected an int in [0, 2**64), got {}",
                                            std::string(py::repr(seed))));
        return workerSeed(seed.cast<std::uint64_t>(), global_rank, step);
      },
      "seed"_a, "rank"_a, "step"_a,
      "The seed worker `rank` (its global rank) gives torch.manual_seed before its shard "
      "function in global step `step`, given the run's seed (Aggregator(seed=...), by default "
      "torch.initial_seed() when the aggregator was made): a one-process reference of a run "
      "with dropout seeds the same before computing worker r's part.");
  bindStopSignals(m);
}

}  // namespace gradagg::python
