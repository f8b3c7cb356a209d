// The parent side of the step protocol.
//
// Construction: list the model's tensors, plan the layout, map the segment,
// move parameters and buffers into its snapshot, fork the workers, wait until
// every one has arrived once (its replica set up).
//
// A step, in the words of layout.h:
//   1. publish: check that every tensor still lives in the snapshot (the
//      optimizer updated it in place: nothing to copy), write the command, set
//      `remaining` to N, bump command_seq and wake the workers;
//   2. compute: each worker loads the snapshot, runs the shard function and
//      backward into its slot, and arrives; the parent waits on `remaining` with
//      a deadline, checking that every worker is alive;
//   3. reduce: the weighted sum of the slots, parameter by parameter, in rank
//      order, into the result region that the parameters' .grad view;
//   4. buffers follow Options::buffers.
// Nothing the user can see changes before step 3, so a failed step changes
// nothing: not the parameters, not .grad, not the buffers.
#include <gradagg/aggregator.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/nn/module.h>

#include <gradagg/errors.h>

#include "check.h"
#include "layout.h"
#include "model_binding.h"
#include "process.h"
#include "reduce.h"
#include "segment.h"
#include "sync.h"
#include "worker.h"

namespace gradagg {

using namespace detail;

namespace {
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr auto kLivenessSlice = std::chrono::milliseconds(50);

std::optional<ElementType> elementType(c10::ScalarType t) {
  if (t == at::kFloat) return ElementType::kFloat32;
  if (t == at::kDouble) return ElementType::kFloat64;
  return std::nullopt;
}
}  // namespace

struct Aggregator::Impl {
  // Declaration order is destruction order reversed: workers go first, then the
  // model gets its memory back, then the segment is unmapped.
  Options options;
  torch::nn::Module* model;
  ShardFn shard;
  Segment segment;
  ModelBinding binding;
  Layout layout;
  ProcessSet processes;

  bool usable = false;
  std::string unusable_reason;
  std::int64_t steps_done = 0;
  std::uint32_t seq = 0;  // the command_seq of the last command
  StepReport report;
  std::vector<at::Tensor> grad_views;  // result views, one per parameter
  std::vector<const void*> inputs;      // reused by the reduction
  std::vector<double> weights;

  Impl(torch::nn::Module& m, ShardFn fn, Options opts)
      : options((opts.validate(), opts)), model(&m), shard(std::move(fn)), binding(m) {
    if (!shard) throw InvalidArgument("shard function: expected a callable, got an empty ShardFn");
    const int n = options.workers;
    layout = Layout::plan(binding.sizes(n), pageBytes());
    segment = Segment::createAnonymous(layout.segment_bytes);
    initHeader(segment.base(), layout, pageBytes());
    for (int r = 0; r < n; ++r) {
      WorkerControl& c = control(r);
      c.done_seq.store(0xffff'ffffu, std::memory_order_relaxed);  // "never arrived"
      c.phase.store(static_cast<std::uint32_t>(Phase::kStarting), std::memory_order_relaxed);
    }
    std::byte* params = segment.base() + layout.snapshot_offset;
    binding.adopt(params, segment.base() + layout.snapshot_buffers_offset, segment.base(),
                  segment.base() + segment.size());
    for (const TensorEntry& p : binding.params())
      grad_views.push_back(viewAt(p, segment.base() + layout.result_offset));
    inputs.resize(n);
    weights.resize(n);
    report.workers.resize(n);

    header().remaining.store(n, std::memory_order_relaxed);
    const int threads = options.resolvedThreadsPerWorker();
    const pid_t parent = ::getpid();
    for (int r = 0; r < n; ++r) {
      processes.spawn([&, r] {
        WorkerSetup s{r, threads, &segment, &binding, model, &shard, parent};
        return workerMain(s);
      });
    }
    awaitArrivals(0, "start-up");
    for (int r = 0; r < n; ++r) {
      if (control(r).status != static_cast<std::uint32_t>(SlotStatus::kOk))
        fail<WorkerFailed>(r, fmt::format("gradagg: worker {} failed to start: {}", r,
                                          control(r).message),
                           std::string(control(r).message));
    }
    usable = true;
  }

  ~Impl() { shutdown(); }

  Header& header() { return *reinterpret_cast<Header*>(segment.base()); }
  WorkerControl& control(int r) {
    return *reinterpret_cast<WorkerControl*>(segment.base() + layout.control_offset +
                                             sizeof(WorkerControl) * r);
  }
  Phase phaseOf(int r) { return static_cast<Phase>(control(r).phase.load(std::memory_order_relaxed)); }

  // Stops the workers, marks the aggregator unusable and throws E.
  template <typename E, typename... Args>
  [[noreturn]] void fail(int rank, const std::string& what, Args&&... extra) {
    const Phase phase = phaseOf(rank);
    processes.killAll();
    usable = false;
    unusable_reason = what;
    throw E(what, rank, phase, std::forward<Args>(extra)...);
  }

  // Waits until every worker has arrived for command `expected_seq`, with the
  // step deadline and a liveness check every slice.
  void awaitArrivals(std::uint32_t expected_seq, const char* what) {
    auto& remaining = header().remaining;
    const auto deadline = Clock::now() + options.step_timeout;
    std::uint32_t r = spinWhileEqual(remaining, remaining.load(std::memory_order_acquire), kSpin);
    for (;;) {
      r = remaining.load(std::memory_order_acquire);
      if (r == 0) return;
      checkAlive(what);
      const auto now = Clock::now();
      if (now >= deadline) {
        for (int k = 0; k < options.workers; ++k) {
          if (control(k).done_seq.load(std::memory_order_acquire) == expected_seq) continue;
          fail<StepTimeout>(k, fmt::format("gradagg: worker {} did not finish {} within {} ms (it "
                                           "is in phase '{}'); the workers were stopped",
                                           k, what, options.step_timeout.count(),
                                           phaseName(phaseOf(k))));
        }
        GRADAGG_ENFORCE(false, "deadline passed with {} workers remaining but none late", r);
      }
      futexWait(remaining, r, std::min<Clock::duration>(kLivenessSlice, deadline - now));
    }
  }

  void checkAlive(const char* what) {
    for (int k = 0; k < options.workers; ++k) {
      if (auto exit = processes.poll(k)) {
        const Phase phase = phaseOf(k);
        const std::string msg = fmt::format(
            "gradagg: worker {} (pid {}) {} in phase '{}' during {}; the other workers were "
            "stopped",
            k, processes.pid(k), exit->describe(), phaseName(phase), what);
        processes.killAll();
        usable = false;
        unusable_reason = msg;
        throw WorkerDied(msg, k, phase, exit->exit_status, exit->signal);
      }
    }
  }

  void command(Command c) {
    Header& h = header();
    h.command = static_cast<std::uint32_t>(c);
    h.step = steps_done;
    h.training = model->is_training() ? 1 : 0;
    h.remaining.store(static_cast<std::uint32_t>(options.workers), std::memory_order_relaxed);
    seq = h.command_seq.fetch_add(1, std::memory_order_release) + 1;
    futexWakeAll(h.command_seq);
  }

  const StepReport& step() {
    if (!usable) throw NotUsable("gradagg: the aggregator is not usable: " + unusable_reason);
    const auto t0 = Clock::now();
    binding.verify();
    command(Command::kStep);
    const auto t1 = Clock::now();
    const std::string what = fmt::format("step {}", steps_done);
    awaitArrivals(seq, what.c_str());
    const auto t2 = Clock::now();
    for (int r = 0; r < options.workers; ++r) {
      WorkerControl& c = control(r);
      if (c.status != static_cast<std::uint32_t>(SlotStatus::kOk))
        throw WorkerFailed(fmt::format("gradagg: worker {} failed in phase '{}' of step {}: {}", r,
                                       phaseName(lastPhase(r)), steps_done, c.message),
                           r, lastPhase(r), c.message);
    }
    computeWeights();
    reduceGradients();
    syncBuffers();
    const auto t3 = Clock::now();
    fillReport(t0, t1, t2, t3);
    ++steps_done;
    return report;
  }

  // The phase a worker failed in: it is kWaiting again once it arrived, so the
  // failure phase is recorded separately: the phase before arriving.
  Phase lastPhase(int r) { return static_cast<Phase>(control(r).failed_phase); }

  void computeWeights() {
    const int n = options.workers;
    double total = 0;
    for (int r = 0; r < n; ++r) total += static_cast<double>(control(r).samples);
    for (int r = 0; r < n; ++r)
      weights[r] = options.weighting == Weighting::kEqual
                       ? 1.0 / n
                       : static_cast<double>(control(r).samples) / total;
  }

  void reduceGradients() {
    const int n = options.workers;
    auto& params = binding.params();
    std::byte* result = segment.base() + layout.result_offset;
    for (std::size_t k = 0; k < params.size(); ++k) {
      TensorEntry& p = params[k];
      bool any = false;
      for (int r = 0; r < n; ++r) {
        const std::byte* slot = segment.base() + layout.slotOffset(r);
        any = any || slot[layout.slot_flags_offset + k] != std::byte{0};
        inputs[r] = slot + p.offset;
      }
      if (!any) {
        if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
        continue;
      }
      weightedSum(*elementType(p.dtype), result + p.offset, inputs.data(), weights.data(), n,
                  static_cast<std::size_t>(p.tensor.numel()));
      if (!p.tensor.grad().is_same(grad_views[k])) p.tensor.mutable_grad() = grad_views[k];
    }
  }

  void syncBuffers() {
    if (options.buffers == BufferSync::kKeepParent) return;
    const int n = options.workers;
    std::byte* master = binding.bufferRegion();
    auto slotBuffers = [&](int r) {
      return segment.base() + layout.slotOffset(r) + layout.slot_buffers_offset;
    };
    for (TensorEntry& b : binding.buffers()) {
      const auto type = elementType(b.dtype);
      if (options.buffers == BufferSync::kMean && type) {
        for (int r = 0; r < n; ++r) inputs[r] = slotBuffers(r) + b.offset;
        weightedSum(*type, master + b.offset, inputs.data(), weights.data(), n,
                    static_cast<std::size_t>(b.tensor.numel()));
      } else {
        std::memcpy(master + b.offset, slotBuffers(0) + b.offset, b.bytes);
      }
    }
  }

  void fillReport(Clock::time_point t0, Clock::time_point t1, Clock::time_point t2,
                  Clock::time_point t3) {
    using Ms = std::chrono::duration<double, std::milli>;
    report.step = steps_done;
    report.loss = 0;
    report.samples = 0;
    for (int r = 0; r < options.workers; ++r) {
      const WorkerControl& c = control(r);
      report.workers[r] = WorkerReport{c.loss, c.samples, c.shard_ms, c.backward_ms};
      report.loss += weights[r] * c.loss;
      report.samples += c.samples;
    }
    report.publish_ms = Ms(t1 - t0).count();
    report.compute_ms = Ms(t2 - t1).count();
    report.reduce_ms = Ms(t3 - t2).count();
    report.total_ms = Ms(t3 - t0).count();
  }

  void shutdown() noexcept {
    if (usable) {
      command(Command::kStop);
      if (!processes.waitAll(options.shutdown_timeout)) processes.killAll();
    }
    processes.killAll();
    if (usable) unusable_reason = "it was shut down";
    usable = false;
  }
};

Aggregator::Aggregator(torch::nn::Module& model, ShardFn shard, Options options)
    : impl_(std::make_unique<Impl>(model, std::move(shard), options)) {}
Aggregator::~Aggregator() = default;
Aggregator::Aggregator(Aggregator&&) noexcept = default;
Aggregator& Aggregator::operator=(Aggregator&&) noexcept = default;

const StepReport& Aggregator::step() {
  if (!impl_) throw NotUsable("gradagg: the aggregator was moved from");
  return impl_->step();
}
void Aggregator::shutdown() {
  if (impl_) impl_->shutdown();
}
bool Aggregator::usable() const noexcept { return impl_ && impl_->usable; }
int Aggregator::workers() const noexcept { return impl_ ? impl_->options.workers : 0; }
std::int64_t Aggregator::stepsDone() const noexcept { return impl_ ? impl_->steps_done : 0; }
const Options& Aggregator::options() const noexcept { return impl_->options; }

}  // namespace gradagg
