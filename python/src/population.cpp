// gradagg._core._Population: the C++ Population (gradagg/population.h) for a
// Python model and Python functions. What is Python's own here:
//   - each member's optimizer is a Python torch.optim optimizer, seen by the
//     C++ member as a PyOptimizer: its state is its state_dict(), torch.save'd
//     into bytes in the member and copied through the shared segment (never a
//     pipe); a copy or a resume load_state_dict()s it;
//   - the user's functions run with the GIL held, in the member's own thread
//     (train_step, score, make_optimizer, init_weights, apply_hyperparams, a
//     custom policy, resample) or in the parent before the fork (hyperparams);
//     a Python exception becomes the member's message, traceback included;
//   - every wait (construction, generation, checkpoint, shutdown) runs with the
//     GIL released; Ctrl-C raises KeyboardInterrupt once the members stopped.
// gradagg/population.py adds keyword arguments, state_dict(rank) and the
// context manager on top.
#include <mutex>
#include <stdexcept>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <gradagg/population.h>

#include "host.h"
#include "ints.h"
#include "model_view.h"
#include "population.h"
#include "runtime/interrupt.h"
#include "shard.h"
#include "threads.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace gradagg::python {

namespace {

constexpr const char* kStateKey = "python_state_dict";

// Calls f with the GIL held in any thread; a Python exception becomes a
// std::runtime_error carrying its text and traceback.
template <class F>
decltype(auto) withGil(F&& f) {
  ensureThreadState();
  py::gil_scoped_acquire gil;
  try {
    return f();
  } catch (py::error_already_set& e) {
    throw std::runtime_error(describePythonError(e));
  }
}

// A member's Python optimizer, as the C++ member sees it.
class PyOptimizer final : public torch::optim::Optimizer {
 public:
  explicit PyOptimizer(py::object optimizer)
      : Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                  std::make_unique<torch::optim::SGDOptions>(0.0)),
        optimizer_(std::move(optimizer)) {}

  at::Tensor step(LossClosure) override {
    throw InvalidArgument("call ctx.optimizer.step() in train_step");
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    std::string bytes = withGil([&] {
      const py::object buffer = py::module_::import("io").attr("BytesIO")();
      py::module_::import("torch").attr("save")((*optimizer_).attr("state_dict")(), buffer);
      return buffer.attr("getvalue")().cast<std::string>();
    });
    archive.write(kStateKey, c10::IValue(std::move(bytes)));
  }

  void load(torch::serialize::InputArchive& archive) override {
    c10::IValue value;
    if (!archive.try_read(kStateKey, value) || !value.isString())
      throw InvalidArgument(
          "the optimizer state is not a Python optimizer's (a C++ population's checkpoint?)");
    withGil([&] {
      const py::object buffer =
          py::module_::import("io").attr("BytesIO")(py::bytes(value.toStringRef()));
      (*optimizer_).attr("load_state_dict")(py::module_::import("torch").attr("load")(buffer));
    });
  }

  const py::object& object() const { return *optimizer_; }

 private:
  PyRef optimizer_;
};

py::object optimizerOf(const MemberContext& c) {
  const auto* o = dynamic_cast<const PyOptimizer*>(c.optimizer);
  return o != nullptr ? o->object() : py::none();
}

// What train_step and score see: valid during the call (rng above all).
struct PyMemberContext {
  int rank, workers;
  std::int64_t step;
  Hyperparams hyperparams;
  py::object optimizer;
  DecisionRng* rng;
};

PyMemberContext contextOf(const MemberContext& c) {
  return {c.rank, c.workers, c.step, *c.hyperparams, optimizerOf(c), c.rng};
}

py::object rngRef(DecisionRng& rng) { return py::cast(&rng, py::return_value_policy::reference); }

Hyperparams hyperparamsOf(const py::handle& r, const char* what) {
  if (!py::isinstance<py::dict>(r))
    throw InvalidArgument(
        fmt::format("{} must return a dict of str -> float, got {}", what, typeName(r)));
  try {
    return r.cast<Hyperparams>();
  } catch (const py::cast_error&) {
    throw InvalidArgument(fmt::format("{} must return a dict of str -> float", what));
  }
}

PyRef callable(py::object f, const char* what) {
  if (!PyCallable_Check(f.ptr()))
    throw InvalidArgument(fmt::format("{}: expected a callable", what));
  return PyRef(std::move(f));
}

PopulationFns fnsOf(const py::object& make_optimizer, const py::object& hyperparams,
                    const py::object& train_step, const py::object& score,
                    const py::object& init_weights, const py::object& apply_hyperparams) {
  PopulationFns fns;
  const PyRef make = callable(make_optimizer, "make_optimizer");
  fns.make_optimizer = [make](torch::nn::Module&, const Hyperparams& hp) {
    return withGil([&]() -> std::unique_ptr<torch::optim::Optimizer> {
      py::object o = (*make)(hp);
      if (!py::hasattr(o, "state_dict") || !py::hasattr(o, "load_state_dict") ||
          !py::hasattr(o, "param_groups"))
        throw InvalidArgument(
            fmt::format("make_optimizer must return a torch.optim optimizer, got {}", typeName(o)));
      return std::make_unique<PyOptimizer>(std::move(o));
    });
  };
  const PyRef draw = callable(hyperparams, "hyperparams");
  fns.hyperparams = [draw](int rank, DecisionRng& rng) {
    py::gil_scoped_acquire gil;
    try {
      return hyperparamsOf((*draw)(rank, rngRef(rng)), "hyperparams");
    } catch (py::error_already_set& e) {
      throw InvalidArgument("hyperparams(" + std::to_string(rank) + "): " + describePythonError(e));
    }
  };
  const PyRef train = callable(train_step, "train_step");
  fns.train_step = [train](const MemberContext& c) { withGil([&] { (*train)(contextOf(c)); }); };
  const PyRef judge = callable(score, "score");
  fns.score = [judge](const MemberContext& c) {
    return withGil([&] {
      const py::object s = (*judge)(contextOf(c));
      if (THPVariable_Check(s.ptr())) return THPVariable_Unpack(s.ptr()).item<double>();
      if (!py::isinstance<py::float_>(s) && !py::isinstance<py::int_>(s))
        throw InvalidArgument(fmt::format("score must return a number, got {}", typeName(s)));
      return s.cast<double>();
    });
  };
  if (!init_weights.is_none()) {
    const PyRef init = callable(init_weights, "init_weights");
    fns.init_weights = [init](int rank, torch::nn::Module&, DecisionRng& rng) {
      withGil([&] { (*init)(rank, rngRef(rng)); });
    };
  }
  if (!apply_hyperparams.is_none()) {
    const PyRef apply = callable(apply_hyperparams, "apply_hyperparams");
    fns.apply_hyperparams = [apply](torch::optim::Optimizer& o, const Hyperparams& hp) {
      withGil([&] { (*apply)(dynamic_cast<PyOptimizer&>(o).object(), hp); });
    };
  } else {
    fns.apply_hyperparams = [](torch::optim::Optimizer& o, const Hyperparams& hp) {
      const auto lr = hp.find("lr");
      if (lr == hp.end()) return;
      withGil([&] {
        for (py::handle group : dynamic_cast<PyOptimizer&>(o).object().attr("param_groups"))
          group["lr"] = lr->second;
      });
    };
  }
  return fns;
}

std::chrono::milliseconds secondsOf(const py::handle& v, const char* name) {
  const double s = v.cast<double>();
  if (!(s > 0)) throw InvalidArgument(fmt::format("{}: {} s is not positive", name, s));
  return std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000.0 + 0.5));
}

// PopulationOptions from the keyword arguments; an unknown one is named.
PopulationOptions optionsOf(const Policy& policy, const py::kwargs& kw) {
  PopulationOptions o;
  o.policy = policy;
  for (auto [key, value] : kw) {
    const auto k = key.cast<std::string>();
    if (k == "workers")
      o.workers = checkedInt<int>(value, k);
    else if (k == "publish_interval")
      o.publish_interval = checkedInt<std::int64_t>(value, k);
    else if (k == "seed")
      o.seed = checkedInt<std::uint64_t>(value, k);
    else if (k == "higher_is_better")
      o.higher_is_better = value.cast<bool>();
    else if (k == "ready_interval")
      o.ready_interval = checkedInt<std::int64_t>(value, k);
    else if (k == "copy_optimizer_state")
      o.copy_optimizer_state = value.cast<bool>();
    else if (k == "copy_hyperparams")
      o.copy_hyperparams = value.cast<bool>();
    else if (k == "optimizer_state_bytes")
      o.optimizer_state_bytes = checkedInt<std::size_t>(value, k);
    else if (k == "lineage_path")
      o.lineage_path = py::str(value);
    else if (k == "resume_from")
      o.resume_from = py::str(value);
    else if (k == "threads_per_worker")
      o.threads_per_worker = checkedInt<int>(value, k);
    else if (k == "keep_worker_memory")
      o.keep_worker_memory = value.cast<bool>();
    else if (k == "step_timeout")
      o.step_timeout = secondsOf(value, "step_timeout");
    else if (k == "shutdown_timeout")
      o.shutdown_timeout = secondsOf(value, "shutdown_timeout");
    else if (k == "max_restarts")
      o.max_restarts = checkedInt<int>(value, k);
    else if (k == "explore") {
      const auto e = value.cast<std::string>();
      if (e == "none")
        o.explore = Explore::kNone;
      else if (e == "perturb")
        o.explore = Explore::kPerturb;
      else if (e == "resample")
        o.explore = Explore::kResample;
      else
        throw InvalidArgument("explore: '" + e + "' is not 'none', 'perturb' or 'resample'");
    } else if (k == "resample") {
      if (value.is_none()) continue;
      const PyRef f = callable(py::reinterpret_borrow<py::object>(value), "resample");
      o.resample = [f](const Hyperparams& hp, DecisionRng& rng) {
        return withGil([&] { return hyperparamsOf((*f)(hp, rngRef(rng)), "resample"); });
      };
    } else {
      throw InvalidArgument("Population: no option '" + k + "'");
    }
  }
  return o;
}

// The Python side of one Population: owns it, releases the GIL around it.
class PyPopulation {
 public:
  PyPopulation(const py::object& model, const py::object& make_optimizer,
               const py::object& hyperparams, const py::object& train_step, const py::object& score,
               const py::object& init_weights, const py::object& apply_hyperparams,
               const Policy& policy, const py::kwargs& kw) {
    ModelView view = viewOfPython(model);
    PopulationFns fns =
        fnsOf(make_optimizer, hyperparams, train_step, score, init_weights, apply_hyperparams);
    PopulationOptions options = optionsOf(policy, kw);
    policy_name_ = policy.name();
    detail::clearInterrupt();
    pop_ = withoutGil([&] {
      return std::make_unique<Population>(std::move(view), std::move(fns), std::move(options));
    });
  }

  Population& pop() const {
    if (!pop_) throw NotUsable("gradagg: the population is shut down");
    return *pop_;
  }
  // The lock is taken without the GIL (the members' Python functions need it), so
  // a second Python thread calling any of these waits for the first, as
  // Aggregator.step() does: the population's channel carries one command at a time.
  std::vector<CopyEvent> generation() {
    Population& p = pop();
    return withoutGil([&] {
      std::lock_guard<std::mutex> lock(mutex_);
      return p.generation();
    });
  }
  MemberSnapshot snapshot(int rank) const {
    const Population& p = pop();
    return withoutGil([&] {
      std::lock_guard<std::mutex> lock(mutex_);
      return p.snapshot(rank);
    });
  }
  void checkpoint(const std::string& path) const {
    const Population& p = pop();
    withoutGil([&] {
      std::lock_guard<std::mutex> lock(mutex_);
      p.checkpoint(path);
    });
  }
  void shutdown() {
    if (pop_)
      withoutGil([&] {
        std::lock_guard<std::mutex> lock(mutex_);
        pop_->shutdown();
      });
  }
  const std::string& policyName() const { return policy_name_; }

 private:
  std::unique_ptr<Population> pop_;
  std::string policy_name_;
  mutable std::mutex mutex_;  // one generation(), snapshot(), checkpoint() or shutdown() at a time
};

py::list tensorList(const std::vector<at::Tensor>& ts) {
  py::list out;
  for (const at::Tensor& t : ts) out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
  return out;
}

}  // namespace

void bindPopulation(py::module_& m) {
  py::class_<DecisionRng>(m, "DecisionRng",
                          "The population's deterministic generator (splitmix64); one derived "
                          "from (seed, rank, step) is passed to each call, valid during it.")
      .def(py::init<std::uint64_t>(), "state"_a)
      .def_static("derive", &DecisionRng::derive, "seed"_a, "rank"_a, "step"_a, "stream"_a)
      .def("next", &DecisionRng::next, "The next 64 random bits.")
      .def("uniform", &DecisionRng::uniform, "A float in [0, 1) (53 bits).")
      .def("below", &DecisionRng::below, "n"_a, "An int in [0, n), n > 0.");

  py::class_<PolicyInput>(m, "PolicyInput", "What a policy sees at a publish point.")
      .def_readonly("rank", &PolicyInput::rank)
      .def_readonly("workers", &PolicyInput::workers)
      .def_readonly("step", &PolicyInput::step)
      .def_readonly("scores", &PolicyInput::scores)
      .def_readonly("higher_is_better", &PolicyInput::higher_is_better)
      .def("__repr__", [](const PolicyInput& in) {
        return fmt::format("PolicyInput(rank={}, workers={}, step={}, scores=[{}])", in.rank,
                           in.workers, in.step, fmt::join(in.scores, ", "));
      });

  py::class_<Policy>(m, "Policy", "Whether a member copies a peer at a publish point.")
      .def_static("none", &Policy::none)
      .def_static("random", &Policy::random, "p"_a, "With probability p, a random other member.")
      .def_static("truncation", &Policy::truncation, "fraction"_a = 0.2,
                  "The bottom fraction copies a random one of the top fraction.")
      .def_static("tournament", &Policy::tournament,
                  "A random other member, copied when it scores strictly better.")
      .def_static(
          "custom",
          [](std::string name, py::object fn) {
            const PyRef f = callable(std::move(fn), "Policy.custom");
            return Policy::custom(std::move(name), [f](const PolicyInput& in, DecisionRng& rng) {
              return withGil([&] {
                const py::object r = (*f)(in, rngRef(rng));
                if (!py::isinstance<py::int_>(r))
                  throw InvalidArgument(
                      fmt::format("the policy must return a rank or -1, got {}", typeName(r)));
                return checkedInt<int>(r, "the policy's rank");
              });
            });
          },
          "name"_a, "fn"_a,
          "fn(input: PolicyInput, rng: DecisionRng) -> donor rank or -1, in "
          "the member.")
      .def_property_readonly("name", &Policy::name)
      .def("__repr__", [](const Policy& p) { return "Policy(" + p.name() + ")"; });

  py::class_<PyMemberContext>(m, "MemberContext",
                              "What train_step and score see, valid during the call.")
      .def_readonly("rank", &PyMemberContext::rank)
      .def_readonly("workers", &PyMemberContext::workers)
      .def_readonly("step", &PyMemberContext::step)
      .def_readonly("hyperparams", &PyMemberContext::hyperparams)
      .def_readonly("optimizer", &PyMemberContext::optimizer)
      .def_property_readonly("rng", [](PyMemberContext& c) { return rngRef(*c.rng); })
      .def("__repr__", [](const PyMemberContext& c) {
        return fmt::format("MemberContext(rank={}, workers={}, step={})", c.rank, c.workers,
                           c.step);
      });

  py::class_<CopyEvent>(m, "CopyEvent", "One copy made at a publish point (a lineage line).")
      .def_readonly("step", &CopyEvent::step)
      .def_readonly("worker", &CopyEvent::worker)
      .def_readonly("donor", &CopyEvent::donor)
      .def_readonly("donor_version", &CopyEvent::donor_version)
      .def_readonly("score", &CopyEvent::score)
      .def_readonly("donor_score", &CopyEvent::donor_score)
      .def_readonly("before", &CopyEvent::before)
      .def_readonly("after", &CopyEvent::after)
      .def("__repr__", [](const CopyEvent& e) {
        return fmt::format(
            "CopyEvent(step={}, worker={}, donor={}, score={:.6g}, "
            "donor_score={:.6g})",
            e.step, e.worker, e.donor, e.score, e.donor_score);
      });

  py::class_<MemberSnapshot>(m, "MemberSnapshot", "A member's latest complete snapshot.")
      .def_readonly("rank", &MemberSnapshot::rank)
      .def_readonly("version", &MemberSnapshot::version)
      .def_readonly("step", &MemberSnapshot::step)
      .def_readonly("last_copy_step", &MemberSnapshot::last_copy_step)
      .def_readonly("score", &MemberSnapshot::score)
      .def_readonly("hyperparams", &MemberSnapshot::hyperparams)
      .def_property_readonly("parameters",
                             [](const MemberSnapshot& s) { return tensorList(s.parameters); })
      .def_property_readonly("buffers",
                             [](const MemberSnapshot& s) { return tensorList(s.buffers); })
      .def_property_readonly("optimizer_state",
                             [](const MemberSnapshot& s) { return py::bytes(s.optimizer_state); })
      .def("__repr__", [](const MemberSnapshot& s) {
        return fmt::format("MemberSnapshot(rank={}, version={}, step={}, score={:.6g})", s.rank,
                           s.version, s.step, s.score);
      });

  py::class_<PyPopulation>(m, "_Population")
      .def(py::init<const py::object&, const py::object&, const py::object&, const py::object&,
                    const py::object&, const py::object&, const py::object&, const Policy&,
                    const py::kwargs&>(),
           "model"_a, "make_optimizer"_a, "hyperparams"_a, "train_step"_a, "score"_a,
           "init_weights"_a, "apply_hyperparams"_a, "policy"_a)
      .def("generation", &PyPopulation::generation,
           "Every member trains publish_interval steps and publishes, then decides and copies. "
           "Returns the copies made (CopyEvent).")
      .def("snapshot", &PyPopulation::snapshot, "rank"_a)
      .def("checkpoint", &PyPopulation::checkpoint, "path"_a)
      .def("shutdown", &PyPopulation::shutdown, "Stops and reaps the members (idempotent).")
      .def_property_readonly("usable", [](const PyPopulation& p) { return p.pop().usable(); })
      .def_property_readonly("restarts", [](const PyPopulation& p) { return p.pop().restarts(); })
      .def_property_readonly("workers", [](const PyPopulation& p) { return p.pop().workers(); })
      .def_property_readonly("hyperparam_names",
                             [](const PyPopulation& p) { return p.pop().hyperparamNames(); })
      .def_property_readonly("worker_pids",
                             [](const PyPopulation& p) { return p.pop().workerPids(); })
      .def_property_readonly("policy_name", &PyPopulation::policyName);
}

}  // namespace gradagg::python
