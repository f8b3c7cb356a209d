// gradagg._core: the C++ Aggregator for Python. The pieces that are Python's
// own: a Python torch.nn.Module as a ModelView, a Python shard function as a
// ShardFn (its exceptions become the worker's message, traceback included),
// the GIL released for every wait, and options with Python's types (seconds,
// strings for the enums: options.cpp). gradagg/__init__.py adds keyword
// arguments and the context manager on top.
#include <mutex>
#include <optional>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>

#include <fmt/format.h>

#include <gradagg/aggregator.h>
#include <gradagg/blas.h>
#include <gradagg/errors.h>

#include "durable.h"
#include "errors.h"
#include "host.h"
#include "loop.h"
#include "model_view.h"
#include "options.h"
#include "population.h"
#include "runtime/interrupt.h"
#include "shard.h"
#include "threads.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace gradagg::python {

namespace {

// The Python side of one Aggregator: owns it, releases the GIL around it.
class PyAggregator {
 public:
  PyAggregator(const py::object& model, py::object shard, Options options) {
    ModelView view = viewOfPython(model);
    ShardFn fn = shardOfPython(std::move(shard));
    // A Ctrl-C that ended an earlier aggregator's wait is not this one's: the
    // Python program went on (it caught KeyboardInterrupt), and the new
    // aggregator's waits see its own signals.
    detail::clearInterrupt();
    agg_ = withoutGil([&] {
      return std::make_unique<Aggregator>(std::move(view), std::move(fn), std::move(options));
    });
  }

  // A copy: the next step reuses the report. The lock is taken without the GIL,
  // so a second Python thread calling step() or close() waits for this one.
  StepReport step(const std::optional<BatchPosition>& position, const py::object& message) {
    Aggregator& a = agg();
    Message m;
    if (!message.is_none()) {
      if (!py::isinstance<py::dict>(message))
        throw InvalidArgument(
            fmt::format("message: expected a dict of str -> tensor, int or "
                        "float, got {}",
                        typeName(message)));
      m = messageOf(message.cast<py::dict>());
    }
    return withoutGil([&] {
      std::lock_guard<std::mutex> lock(mutex_);
      return position ? a.step(*position, m) : a.step(m);
    });
  }
  void close() {
    if (agg_)
      withoutGil([&] {
        std::lock_guard<std::mutex> lock(mutex_);
        agg_->shutdown();
      });
  }
  Aggregator& agg() {
    if (!agg_) throw NotUsable("gradagg: the aggregator is closed");
    return *agg_;
  }

 private:
  std::unique_ptr<Aggregator> agg_;
  std::mutex mutex_;  // one step() or close() at a time
};

void bindShardContext(py::module_& m) {
  py::class_<ShardContext>(m, "ShardContext", "Who a shard function is and which step it computes.")
      .def_readonly("rank", &ShardContext::rank)
      .def_readonly("workers", &ShardContext::workers)
      .def_readonly("step", &ShardContext::step)
      .def_readonly("global_rank", &ShardContext::global_rank)
      .def_readonly("global_workers", &ShardContext::global_workers)
      .def_readonly("node", &ShardContext::node)
      .def_readonly("nodes", &ShardContext::nodes)
      .def_readonly("micro_step", &ShardContext::micro_step)
      .def_readonly("micro_steps", &ShardContext::micro_steps)
      .def_property_readonly(
          "position", [](const ShardContext& c) { return c.position; },
          "The parent's step(position): a BatchPosition (ShardedBatches.batch reads that "
          "batch); None for a step without one.")
      .def_property_readonly(
          "message", [](const ShardContext& c) { return messageDict(c.message); },
          "The parent's step(message): a dict of read-only tensors and numbers, valid "
          "during this call ({} without one).")
      .def("__repr__", [](const ShardContext& c) {
        return fmt::format(
            "ShardContext(rank={}, workers={}, step={}, micro_step={}{})", c.rank, c.workers,
            c.step, c.micro_step,
            c.position ? fmt::format(", position=({}, {})", c.position->epoch, c.position->index)
                       : "");
      });
  m.def("_in_shard_function", &inShardFunction,
        "Whether this thread runs a shard function now (in a gradagg worker).");
}

void bindReports(py::module_& m) {
  py::class_<WorkerReport>(m, "WorkerReport", "One worker's part of a step (times in ms).")
      .def_readonly("loss", &WorkerReport::loss)
      .def_readonly("samples", &WorkerReport::samples)
      .def_readonly("wake_ms", &WorkerReport::wake_ms)
      .def_readonly("load_ms", &WorkerReport::load_ms)
      .def_readonly("shard_ms", &WorkerReport::shard_ms)
      .def_readonly("backward_ms", &WorkerReport::backward_ms)
      .def_readonly("write_ms", &WorkerReport::write_ms)
      .def_readonly("barrier_ms", &WorkerReport::barrier_ms)
      .def_readonly("reduce_ms", &WorkerReport::reduce_ms)
      .def_readonly("metrics", &WorkerReport::metrics)
      .def("__repr__", [](const WorkerReport& w) {
        return fmt::format(
            "WorkerReport(loss={:.6g}, samples={}, shard_ms={:.3f}, "
            "backward_ms={:.3f})",
            w.loss, w.samples, w.shard_ms, w.backward_ms);
      });

  py::class_<StepReport>(m, "StepReport", "What one step did (times in ms).")
      .def_readonly("step", &StepReport::step)
      .def_readonly("loss", &StepReport::loss)
      .def_readonly("samples", &StepReport::samples)
      .def_readonly("publish_ms", &StepReport::publish_ms)
      .def_readonly("compute_ms", &StepReport::compute_ms)
      .def_readonly("reduce_ms", &StepReport::reduce_ms)
      .def_readonly("node_ms", &StepReport::node_ms)
      .def_readonly("node_bytes", &StepReport::node_bytes)
      .def_readonly("node_collectives", &StepReport::node_collectives)
      .def_readonly("node_overlapped", &StepReport::node_overlapped)
      .def_readonly("apply_ms", &StepReport::apply_ms)
      .def_readonly("total_ms", &StepReport::total_ms)
      .def_readonly("skipped", &StepReport::skipped)
      .def_readonly("consecutive_skips", &StepReport::consecutive_skips)
      .def_readonly("skipped_total", &StepReport::skipped_total)
      .def_readonly("restarts", &StepReport::restarts)
      .def_readonly("workers", &StepReport::workers)
      .def_readonly("metrics", &StepReport::metrics)
      .def("__repr__", [](const StepReport& r) {
        return fmt::format("StepReport(step={}, loss={:.6g}, samples={}, total_ms={:.3f}{})",
                           r.step, r.loss, r.samples, r.total_ms, r.skipped ? ", skipped" : "");
      });
}

void bindAggregator(py::module_& m) {
  py::class_<PyAggregator>(m, "_Aggregator")
      .def(py::init<const py::object&, py::object, Options>(), "model"_a, "shard"_a, "options"_a)
      // step(position[, message]) first: a dict is not a BatchPosition, so step(message)
      // falls through to the second, whose `position` keyword is there to name a wrong one.
      .def("step", &PyAggregator::step, "position"_a, "message"_a = py::none(),
           "Every worker runs the shard function; each parameter's .grad becomes the weighted "
           "mean gradient. Call optimizer.step() after it. On an error nothing changes. "
           "position: a BatchPosition (ShardedBatches.steps(epoch)) the shard functions read "
           "as ctx.position; one before .position is an InvalidArgument. message: a dict of "
           "str -> tensor, int or float the shard functions read as ctx.message.")
      .def(
          "step",
          [](PyAggregator& a, const py::object& message, const py::object& position) {
            if (!position.is_none())
              throw InvalidArgument(fmt::format(
                  "position: expected a gradagg.BatchPosition, got {}", typeName(position)));
            return a.step(std::nullopt, message);
          },
          "message"_a = py::none(), py::kw_only(), "position"_a = py::none())
      .def("close", &PyAggregator::close, "Stops and reaps the workers (idempotent).")
      .def_property_readonly("usable", [](PyAggregator& a) { return a.agg().usable(); })
      .def_property_readonly("workers", [](PyAggregator& a) { return a.agg().workers(); })
      .def_property_readonly("steps_done", [](PyAggregator& a) { return a.agg().stepsDone(); })
      .def_property_readonly(
          "position", [](PyAggregator& a) { return a.agg().position(); },
          "Where the data go on: after step(position), position.next(); after a resume, the "
          "checkpoint's position; (0, 0) before either. Save it with the step.")
      .def_property_readonly("threads_per_worker",
                             [](PyAggregator& a) { return a.agg().threadsPerWorker(); })
      .def_property_readonly("worker_pids", [](PyAggregator& a) { return a.agg().workerPids(); })
      .def_property_readonly("options", [](PyAggregator& a) { return a.agg().options(); });
}

void bindBlas(py::module_& m) {
  py::class_<BlasInfo>(m, "BlasInfo",
                       "The BLAS LibTorch's CPU matrix products call in this process.")
      .def_readonly("library", &BlasInfo::library,
                    "the shared object sgemm_ resolves to, links resolved")
      .def_readonly("vendor", &BlasInfo::vendor, "openblas, mkl, blis, reference or unknown")
      .def_readonly("threading", &BlasInfo::threading, "openmp, pthreads, sequential or unknown")
      .def_readonly("threads", &BlasInfo::threads, "threads its next gemm may use (0: unknown)")
      .def_readonly("config", &BlasInfo::config, "the vendor's own description")
      .def_property_readonly("fast", &BlasInfo::fast, "False for the reference BLAS")
      .def("to_dict",
           [](const BlasInfo& b) {
             return py::dict("library"_a = b.library, "vendor"_a = b.vendor,
                             "threading"_a = b.threading, "threads"_a = b.threads,
                             "config"_a = b.config);
           })
      .def("__str__", &BlasInfo::describe)
      .def("__repr__", [](const BlasInfo& b) { return "BlasInfo(" + b.describe() + ")"; });
  m.def("blas_info", &blasInfo,
        "Which BLAS LibTorch's gemm resolves to in this process, and its threads.");
  m.def("set_blas_threads", &setBlasThreads, "threads"_a,
        "Sets the threads of the BLAS's own pool (OpenBLAS, BLIS, MKL); False where it has none. "
        "torch.set_num_threads does the rest.");
}

}  // namespace

}  // namespace gradagg::python

PYBIND11_MODULE(_core, m) {
  m.doc() = "gradagg's C++ core (use the gradagg package, not this module)";
  m.attr("__version__") = GRADAGG_VERSION;  // CMakeLists.txt's project(VERSION), pip's too
  py::module_::import("torch");             // the tensor type THPVariable_Check tests against
  gradagg::python::installHostHooks();
  gradagg::python::registerErrors();
  gradagg::python::bindOptions(m);
  gradagg::python::bindLoop(m);
  gradagg::python::bindShardContext(m);
  gradagg::python::bindReports(m);
  gradagg::python::bindAggregator(m);
  gradagg::python::bindBlas(m);
  gradagg::python::bindDurable(m);
  gradagg::python::bindPopulation(m);
}
