// The parent side of the step protocol.
//
// Construction: list the model's tensors, plan the layout, map the segment,
// move parameters and buffers into its snapshot, fork the workers, wait until
// every one has arrived once (its replica set up).
//
// A step, in the words of layout.h:
//   1. publish: check that every tensor still lives in the snapshot (the
//      optimizer updated it in place: nothing to copy); write the command, the
//      step, the train/eval mode and which result to fill (the one .grad does
//      not view); set `computed` and `reduced` to N; bump command_seq; wake;
//   2. compute: each worker loads the snapshot, runs the shard function and
//      backward into its slot, and arrives on `computed`;
//   3. reduce: once all have, each worker sums its range of the flat gradient
//      over all slots, in rank order, into the result, and arrives on `reduced`.
//      The parent waits on `reduced` with a deadline, checking every slice that
//      each worker is alive;
//   4. apply: the parameters' .grad move to the new result (or become undefined
//      where no worker produced a gradient); buffers follow Options::buffers.
// Nothing the user can see changes before step 4, so a failed step changes
// nothing: not the parameters, not .grad, not the buffers.
#include <gradagg/aggregator.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/nn/module.h>

#include <gradagg/errors.h>

#include "core/check.h"
#include "multinode/cross_node.h"
#include "core/layout.h"
#include "core/model_binding.h"
#include "core/process.h"
#include "core/reduce.h"
#include "core/segment.h"
#include "core/sync.h"
#include "aggregator/worker.h"

namespace gradagg {

using namespace detail;

namespace {
const std::chrono::nanoseconds kSpin = spinBudget(std::chrono::microseconds(200));
constexpr auto kLivenessSlice = std::chrono::milliseconds(50);

ElementType elementType(c10::ScalarType t) {
  return t == at::kDouble ? ElementType::kFloat64 : ElementType::kFloat32;
}
bool isReducible(c10::ScalarType t) { return t == at::kFloat || t == at::kDouble; }
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
  std::vector<FlatTensor> flat;        // the parameters as the reduction sees them
  std::vector<ByteRange> ranges;       // worker r reduces ranges[r]
  std::vector<const c10::TensorImpl*> param_list;  // model.parameters() at construction
  std::unique_ptr<CrossNode> cross;    // only when the run spans several nodes
  ProcessSet processes;
  int saved_parent_threads = 0;  // to restore, when options.parent_threads > 0

  bool usable = false;
  std::string unusable_reason;
  std::int64_t steps_done = 0;
  std::uint32_t seq = 0;          // the command_seq of the last command
  std::uint32_t grad_result = 1;  // the result .grad views; a step fills the other
  std::vector<at::Tensor> result_views[2];  // per parameter, into each result
  StepReport report;
  std::vector<const void*> inputs;  // reused by the buffer mean
  std::vector<std::int64_t> samples;
  std::vector<double> weights;
  std::vector<std::uint8_t> any_local, any_global;  // per parameter: some worker gave a gradient

  Impl(torch::nn::Module& m, ShardFn fn, Options opts)
      : options((opts.validate(), std::move(opts))), model(&m), shard(std::move(fn)), binding(m) {
    if (!shard) throw InvalidArgument("shard function: expected a callable, got an empty ShardFn");
    const int n = options.workers;
    layout = Layout::plan(binding.sizes(n), pageBytes());
    segment = Segment::createAnonymous(layout.segment_bytes);
    initHeader(segment.base(), layout, pageBytes());
    binding.adopt(segment.base() + layout.snapshot_offset,
                  segment.base() + layout.snapshot_buffers_offset, segment.base(),
                  segment.base() + segment.size());
    for (const TensorEntry& p : binding.params()) {
      flat.push_back(FlatTensor{p.offset, static_cast<std::uint64_t>(p.tensor.numel()),
                                elementType(p.dtype)});
      for (int i = 0; i < 2; ++i)
        result_views[i].push_back(viewAt(p, segment.base() + layout.result_offset[i]));
    }
    ranges = splitRanges(layout.sizes.param_bytes, n);
    for (const auto& p : model->parameters()) param_list.push_back(p.unsafeGetTensorImpl());
    inputs.resize(n);
    samples.resize(n);
    weights.resize(n);
    any_local.resize(binding.params().size());
    any_global.resize(binding.params().size());
    report.workers.resize(n);
    if (options.nodes.nodes > 1)
      cross = std::make_unique<CrossNode>(options.nodes, binding, layout, segment.base(), n);
    startWorkers();
    if (options.parent_threads > 0) {
      saved_parent_threads = at::get_num_threads();
      at::set_num_threads(options.parent_threads);
    }
  }

  ~Impl() {
    shutdown();
    if (saved_parent_threads > 0) at::set_num_threads(saved_parent_threads);
  }

  Header& header() { return *reinterpret_cast<Header*>(segment.base()); }
  WorkerControl& control(int r) {
    return *reinterpret_cast<WorkerControl*>(segment.base() + layout.control_offset +
                                             sizeof(WorkerControl) * r);
  }
  Phase phaseOf(int r) {
    return static_cast<Phase>(control(r).phase.load(std::memory_order_relaxed));
  }
  SlotStatus statusOf(int r) { return static_cast<SlotStatus>(control(r).status); }

  // Forks a fresh group of workers and waits until each has set up its replica.
  void startWorkers() {
    processes.killAll();
    processes.clear();
    const int n = options.workers;
    const std::uint32_t start = header().command_seq.load(std::memory_order_relaxed);
    for (int r = 0; r < n; ++r) {
      WorkerControl& c = control(r);
      c.done_seq.store(start - 1, std::memory_order_relaxed);  // "not arrived"
      c.phase.store(static_cast<std::uint32_t>(Phase::kStarting), std::memory_order_relaxed);
      c.status = static_cast<std::uint32_t>(SlotStatus::kOk);
      c.message[0] = '\0';
    }
    header().reduced.store(static_cast<std::uint32_t>(n), std::memory_order_relaxed);
    const int threads = options.resolvedThreadsPerWorker();
    const pid_t parent = ::getpid();
    for (int r = 0; r < n; ++r) {
      processes.spawn([&, r] {
        WorkerSetup s;
        s.rank = r;
        s.threads = threads;
        s.start_seq = start;
        s.segment = &segment;
        s.layout = layout;
        s.binding = &binding;
        s.model = model;
        s.shard = &shard;
        s.options = &options;
        s.flat = &flat;
        s.range = ranges[r];
        s.parent = parent;
        s.normalize = !cross;
        if (cross) {
          s.node = cross->node();
          s.nodes = cross->nodes();
          s.worker_offset = cross->workerOffset();
          s.global_workers = cross->globalWorkers();
        } else {
          s.global_workers = n;
        }
        return workerMain(s);
      });
    }
    seq = start;
    awaitReduced(-1);
    for (int r = 0; r < n; ++r) {
      if (statusOf(r) != SlotStatus::kOk)
        fail<WorkerFailed>(r, fmt::format("gradagg: worker {} failed to start: {}", r,
                                          control(r).message),
                           std::string(control(r).message));
    }
    usable = true;
  }

  // Stops the workers, marks the aggregator unusable and throws E.
  template <typename E, typename... Args>
  [[noreturn]] void fail(int rank, const std::string& what, Args&&... extra) {
    const Phase phase = phaseOf(rank);
    processes.killAll();
    usable = false;
    unusable_reason = what;
    throw E(what, rank, phase, std::forward<Args>(extra)...);
  }

  // What awaitReduced(step) waits for, in words, for errors only.
  static std::string awaited(std::int64_t step) {
    return step < 0 ? std::string("start-up") : fmt::format("step {}", step);
  }

  // Waits until every worker has arrived on `reduced` for command `seq`, with
  // the step deadline and a liveness check every slice. `step` is -1 at start-up.
  void awaitReduced(std::int64_t step) {
    auto& reduced = header().reduced;
    const auto deadline = Clock::now() + options.step_timeout;
    std::uint32_t r = spinUntilEqual(reduced, 0, kSpin);
    for (;;) {
      r = reduced.load(std::memory_order_acquire);
      if (r == 0) return;
      checkAlive(step);
      const auto now = Clock::now();
      if (now >= deadline) {
        const int k = lateRank();
        fail<StepTimeout>(k, fmt::format("gradagg: worker {} did not finish {} within {} ms (it "
                                         "is in phase '{}'); the workers were stopped",
                                         k, awaited(step), options.step_timeout.count(),
                                         phaseName(phaseOf(k))));
      }
      futexWait(reduced, r, std::min<Clock::duration>(kLivenessSlice, deadline - now));
    }
  }

  // The worker to blame for a missed deadline: the first that has not reached
  // the reduction (the others wait there for it), else the first not done.
  int lateRank() {
    int not_done = -1;
    for (int k = 0; k < options.workers; ++k) {
      if (control(k).done_seq.load(std::memory_order_acquire) == seq) continue;
      if (phaseOf(k) != Phase::kReducing) return k;
      if (not_done < 0) not_done = k;
    }
    GRADAGG_ENFORCE(not_done >= 0, "deadline passed but every worker is done");
    return not_done;
  }

  void checkAlive(std::int64_t step) {
    for (int k = 0; k < options.workers; ++k) {
      if (auto exit = processes.poll(k)) {
        const Phase phase = phaseOf(k);
        const std::string msg = fmt::format(
            "gradagg: worker {} (pid {}) {} in phase '{}' during {}; the other workers were "
            "stopped",
            k, processes.pid(k), exit->describe(), phaseName(phase), awaited(step));
        processes.killAll();
        usable = false;
        unusable_reason = msg;
        throw WorkerDied(msg, k, phase, exit->exit_status, exit->signal);
      }
    }
  }

  void command(Command c) {
    Header& h = header();
    const auto n = static_cast<std::uint32_t>(options.workers);
    h.command = static_cast<std::uint32_t>(c);
    h.step = steps_done;
    h.training = model->is_training() ? 1 : 0;
    h.result_index = 1 - grad_result;
    h.command_ns = nowNs();
    h.computed.store(n, std::memory_order_relaxed);
    h.reduced.store(n, std::memory_order_relaxed);
    seq = h.command_seq.fetch_add(1, std::memory_order_release) + 1;
    futexWakeAll(h.command_seq);
  }

  void verifyModel() {
    binding.verify();
    if (!options.check_parameter_list) return;
    const auto now = model->parameters();
    bool same = now.size() == param_list.size();
    for (std::size_t k = 0; same && k < now.size(); ++k)
      same = now[k].unsafeGetTensorImpl() == param_list[k];
    if (!same)
      throw InvalidArgument(fmt::format(
          "the model's parameter list changed since the Aggregator was created ({} parameters "
          "then, {} now, or other tensors); the workers' replicas were forked with the old one: "
          "create a new Aggregator",
          param_list.size(), now.size()));
  }

  const StepReport& step() {
    for (;;) {
      if (!usable) throw NotUsable("gradagg: the aggregator is not usable: " + unusable_reason);
      try {
        return runStep();
      } catch (const WorkerDied&) {
        if (!restart()) throw;
      } catch (const StepTimeout&) {
        if (!restart()) throw;
      }
    }
  }

  bool restart() {
    if (report.restarts >= options.max_restarts) return false;
    ++report.restarts;
    startWorkers();
    return true;
  }

  // Runs a cross-node call; if it fails, this node's workers are stopped too.
  template <typename F>
  auto crossNode(F&& call) {
    try {
      return call();
    } catch (const NodeFailed& e) {
      processes.killAll();
      usable = false;
      unusable_reason = e.what();
      throw;
    }
  }

  const StepReport& runStep() {
    const int n = options.workers;
    const bool equal = options.weighting == Weighting::kEqual;
    const auto t0 = Clock::now();
    verifyModel();
    const int interval = options.nodes.checksum_interval;
    if (cross && interval > 0 && steps_done > 0 && steps_done % interval == 0)
      crossNode([&] { cross->checkParameters(steps_done); });
    const auto t1 = Clock::now();  // before the command: all the workers' step lies after it
    command(Command::kStep);
    awaitReduced(steps_done);
    const auto t2 = Clock::now();
    int failed = -1, non_finite = -1;
    for (int r = n - 1; r >= 0; --r) {
      if (statusOf(r) == SlotStatus::kFailed) failed = r;
      if (statusOf(r) == SlotStatus::kNonFinite) non_finite = r;
    }
    double total = 0;
    for (int r = 0; r < n; ++r) {
      samples[r] = control(r).samples;
      total += equal ? 1.0 : static_cast<double>(samples[r]);
    }
    computeWeights(equal, samples.data(), n, weights.data());
    localFlags();
    CrossNode::Status global;
    const auto node_t0 = Clock::now();
    if (cross) {
      double loss = 0;
      std::int64_t local_samples = 0;
      for (int r = 0; r < n; ++r) {
        loss += weights[r] * control(r).loss;
        local_samples += samples[r];
      }
      any_global = any_local;
      global = crossNode([&] {
        return cross->exchangeStatus(failed >= 0, non_finite >= 0, total, loss, local_samples,
                                     any_global);
      });
      if (failed < 0 && global.failed > 0)
        throw NodeFailed(fmt::format("gradagg: a worker on another node failed in step {}; no "
                                     "node applied the step (this is node {})",
                                     steps_done, cross->node()),
                         cross->node());
      if (failed < 0 && non_finite < 0 && global.non_finite > 0)
        return skipOrRaise(-1, t0, t1, t2);
    }
    if (failed >= 0) {
      const auto phase = static_cast<Phase>(control(failed).failed_phase);
      throw WorkerFailed(fmt::format("gradagg: worker {} failed in phase '{}' of step {}: {}",
                                     failed, phaseName(phase), steps_done,
                                     control(failed).message),
                         failed, phase, control(failed).message);
    }
    if (non_finite >= 0) return skipOrRaise(non_finite, t0, t1, t2);
    const bool node_buffers = cross && options.buffers == BufferSync::kFromRank0;
    if (cross) {
      crossNode([&] {
        cross->reduceResult(static_cast<int>(1 - grad_result), any_local, any_global,
                            global.total);
        if (node_buffers)
          cross->gatherBuffers(segment.base() + layout.slotOffset(0) + layout.slot_buffers_offset);
      });
    }
    const double node_ms = cross ? millisSince(node_t0) : 0.0;
    report.consecutive_skips = 0;
    report.skipped = false;
    applyGradients(cross ? any_global : any_local);
    if (node_buffers)
      cross->commitBuffers();
    else if (!cross)
      syncBuffers();
    fillReport(t0, t1, t2, Clock::now());
    report.node_ms = node_ms;
    if (cross) {
      report.loss = global.loss;
      report.samples = global.samples;
    }
    ++steps_done;
    return report;
  }

  // Per parameter: did any of this node's workers produce a gradient?
  void localFlags() {
    for (std::size_t k = 0; k < any_local.size(); ++k) {
      bool any = false;
      for (int r = 0; r < options.workers && !any; ++r)
        any = segment.base()[layout.slotOffset(r) + layout.slot_flags_offset + k] != std::byte{0};
      any_local[k] = any ? 1 : 0;
    }
  }

  // A non-finite gradient in worker `r` (or, r < 0, on another node).
  const StepReport& skipOrRaise(int r, Clock::time_point t0, Clock::time_point t1,
                                Clock::time_point t2) {
    const bool skip = options.non_finite == NonFinitePolicy::kSkipStep;
    if (skip && report.consecutive_skips < options.max_consecutive_skips) {
      for (TensorEntry& p : binding.params())
        if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
      ++report.consecutive_skips;
      ++report.skipped_total;
      report.skipped = true;
      std::fill(weights.begin(), weights.end(), 0.0);
      fillReport(t0, t1, t2, Clock::now());
      ++steps_done;
      return report;
    }
    const std::string why =
        skip ? fmt::format("; {} consecutive steps were skipped already (max_consecutive_skips)",
                           report.consecutive_skips)
             : "";
    if (r < 0)
      throw NodeFailed(fmt::format("gradagg: a non-finite gradient on another node in step {}{}; "
                                   "no node applied the step (this is node {})",
                                   steps_done, why, cross->node()),
                       cross->node());
    const int k = control(r).bad_param;
    const std::string param = k >= 0 ? binding.params()[k].name : "";
    const std::string message = control(r).message;
    throw NonFiniteGradient(fmt::format("gradagg: worker {} in step {}: {}{}", r, steps_done,
                                        message, why),
                            r, Phase::kWritingSlot, message, param);
  }

  // .grad of every flagged parameter becomes a view of the new result; the
  // others' .grad becomes undefined.
  void applyGradients(const std::vector<std::uint8_t>& any) {
    const std::uint32_t fresh = 1 - grad_result;
    auto& params = binding.params();
    for (std::size_t k = 0; k < params.size(); ++k) {
      TensorEntry& p = params[k];
      if (any[k])
        p.tensor.mutable_grad() = result_views[fresh][k];
      else if (p.tensor.grad().defined())
        p.tensor.mutable_grad() = at::Tensor();
    }
    grad_result = fresh;
  }

  void syncBuffers() {
    if (options.buffers == BufferSync::kKeepParent) return;
    const int n = options.workers;
    std::byte* master = binding.bufferRegion();
    auto slotBuffers = [&](int r) {
      return segment.base() + layout.slotOffset(r) + layout.slot_buffers_offset;
    };
    for (TensorEntry& b : binding.buffers()) {
      if (options.buffers == BufferSync::kMean && isReducible(b.dtype)) {
        for (int r = 0; r < n; ++r) inputs[r] = slotBuffers(r) + b.offset;
        weightedSum(elementType(b.dtype), master + b.offset, inputs.data(), weights.data(), n,
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
    report.reduce_ms = 0;
    for (int r = 0; r < options.workers; ++r) {
      const WorkerControl& c = control(r);
      report.workers[r] = WorkerReport{c.loss,      c.samples,  c.wake_ms,    c.load_ms,
                                       c.shard_ms,  c.backward_ms, c.write_ms, c.barrier_ms,
                                       c.reduce_ms};
      report.loss += weights[r] * c.loss;
      report.samples += c.samples;
      report.reduce_ms = std::max(report.reduce_ms, c.reduce_ms);
    }
    report.publish_ms = Ms(t1 - t0).count();
    report.compute_ms = Ms(t2 - t1).count();
    report.apply_ms = Ms(t3 - t2).count();
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
    : impl_(std::make_unique<Impl>(model, std::move(shard), std::move(options))) {}
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
std::vector<int> Aggregator::workerPids() const {
  std::vector<int> out;
  if (!impl_ || !impl_->usable) return out;
  for (std::size_t r = 0; r < impl_->processes.size(); ++r) out.push_back(impl_->processes.pid(r));
  return out;
}

}  // namespace gradagg
