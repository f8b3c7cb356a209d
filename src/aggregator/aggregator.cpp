// The parent side of the step protocol.
//
// Construction: list the model's tensors, plan the layout, map the segment,
// move parameters and buffers into its snapshot, fork the workers, wait until
// every one has arrived once (its replica set up).
//
// A step, in the words of layout.h:
//   1. publish: check that every tensor still lives in the snapshot (the
//      optimizer updated it in place: nothing to copy); write the command, the
//      step and its data position, the train/eval mode and which result to
//      fill (the one .grad does not view); set `computed` to N + 1 and
//      `reduced` to N; bump command_seq; wake (the control channel's command);
//   2. compute: each worker loads the snapshot, runs the shard function and
//      backward into its slot (step/slots.h), and arrives on `computed`; the
//      last to arrive (the closer) writes the step's weights and summary once
//      for everyone (step/reduce_scatter.h);
//   3. reduce: then each worker sums its range of the flat gradient over all
//      slots, in rank order, into the result, and arrives on `reduced`.
//      The parent waits on `reduced` with a deadline, checking every slice that
//      each worker is alive; with early buckets it sums those itself first and
//      hands each to the stage as it is ready;
//   4. second stage: the ReductionStage the topology gave (step/stage.h)
//      combines the totals and the result with the other groups', if any;
//   5. apply: the parameters' .grad move to the new result (or become undefined
//      where no worker produced a gradient); buffers follow Options::buffers.
// Nothing the user can see changes before step 5, so a failed step changes
// nothing: not the parameters, not .grad, not the buffers. Every failure goes
// through the control channel's policy (runtime/control.h): one that stops the
// workers names the worker and leaves the aggregator unusable.
#include <gradagg/aggregator.h>

#include <unistd.h>

#include <cstdio>
#include <optional>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <gradagg/errors.h>

#include "aggregator/apply.h"
#include "aggregator/run_cursor.h"
#include "aggregator/step_errors.h"
#include "aggregator/worker.h"
#include "model/model_binding.h"
#include "runtime/blas_warning.h"
#include "runtime/control.h"
#include "runtime/parent_share.h"
#include "runtime/process.h"
#include "runtime/segment.h"
#include "runtime/timeouts.h"
#include "step/layout.h"
#include "step/message.h"
#include "step/metrics.h"
#include "step/reduce_scatter.h"
#include "step/slots.h"
#include "topology/topology.h"

namespace gradagg {

using namespace detail;

namespace {
std::vector<WorkerWords> workerWords(const SegmentMap& map, int workers) {
  std::vector<WorkerWords> words;
  words.reserve(static_cast<std::size_t>(workers));
  for (int r = 0; r < workers; ++r)
    words.push_back({&map.control(r).phase, &map.control(r).done_seq});
  return words;
}
}  // namespace

struct Aggregator::Impl {
  // Declaration order is destruction order reversed: workers go first, then the
  // stage (its sender thread), then the model gets its memory back, then the
  // segment is unmapped.
  Options options;
  ModelView model;
  ShardFn shard;
  Segment segment;
  ModelBinding binding;
  Topology topology;  // where the workers sit, and the reduction's second stage
  SegmentMap map;
  std::optional<ReduceScatter> early_sum;  // the parent's sums of early buckets
  std::optional<SlotReader> slots;
  std::optional<MessageWriter> message;
  std::optional<MetricBook> metrics;
  std::optional<StepErrors> errors;
  std::vector<ByteRange> ranges;                   // worker r reduces ranges[r]
  std::vector<const c10::TensorImpl*> param_list;  // model.parameters() at construction
  std::unique_ptr<Applier> apply;
  ProcessSet processes;
  ParentChannel channel;
  ParentShare parent_share;  // the parent's threads and heap, restored at the end
  int worker_threads = 1;  // intra-op threads per worker (the topology knows who shares the cores)

  std::int64_t steps_done = 0;
  // The step whose stage().beforeStep ran: once per step, not once per try.
  std::int64_t before_step_ran = -1;
  RunCursor cursor;                      // the data's position; checkpoints' loads
  std::optional<BatchPosition> step_at;  // the position of the step being run, if any
  int identical_checks = 0;              // steps checked for identical gradients
  // Early buckets were sent when a wait for the workers failed: the other
  // groups saw the step fail, so this one cannot redo it with fresh workers.
  bool peers_saw_failure = false;
  bool warned_identical = false;       // identical gradients were said (once per Aggregator)
  std::vector<std::uint8_t> any_grad;  // per parameter, this step
  ResultPair results;
  StepReport report;

  ReductionStage& stage() { return *topology.stage; }

  Impl(ModelView m, ShardFn fn, Options opts)
      : options((opts.validate(), std::move(opts))),
        model(std::move(m)),
        shard(std::move(fn)),
        binding(model) {
    if (!shard) throw InvalidArgument("shard function: expected a callable, got an empty ShardFn");
    for (auto* t : {&options.step_timeout, &options.shutdown_timeout, &options.nodes.timeout})
      *t = saturated(*t);
    cursor.start(model, options);  // a checkpoint loaded into the model: its step
    const int n = options.workers;
    topology = joinTopology(options, binding);
    if (!options.seed) options.seed = topology.placement.seed;
    LayoutSizes sizes;
    sizes.workers = static_cast<std::uint32_t>(n);
    sizes.param_count = static_cast<std::uint32_t>(binding.params().size());
    sizes.buffer_count = static_cast<std::uint32_t>(binding.buffers().size());
    sizes.param_bytes = binding.paramBytes();
    sizes.buffer_bytes = binding.bufferBytes();
    sizes.tail_bytes = stage().tailBytes();
    sizes.message_bytes = alignUp(std::max<std::uint64_t>(options.message_bytes, kAlign), kAlign);
    sizes.row_bytes = rowMap(binding.params()).bytes;
    const Layout layout = Layout::plan(sizes, pageBytes());
    segment = Segment::createAnonymous(layout.segment_bytes);
    initHeader(segment.base(), layout, pageBytes());
    map = SegmentMap{segment.base(), layout};
    binding.adopt(map.snapshotParams(), map.snapshotBuffers(), segment.base(),
                  segment.base() + segment.size());
    stage().attach(map);
    early_sum.emplace(map, flatParams(binding), weightRule());
    slots.emplace(map);
    message.emplace(map.message(), sizes.message_bytes);
    metrics.emplace(map);
    errors.emplace(*slots, binding, topology.placement.node);
    steps_done = options.start_step;
    ranges = splitRanges(stage().buckets().workerPart(layout.sizes.param_bytes), n);
    any_grad.resize(binding.params().size());
    if (model.current_parameters)
      for (const auto& p : model.current_parameters())
        param_list.push_back(p.unsafeGetTensorImpl());
    report.workers.resize(n);
    apply = std::make_unique<Applier>(binding, map, options);
    channel = ParentChannel(map.header().command_seq, workerWords(map, n), processes,
                            ChannelNames{"worker", "workers", Phase::kReducing});
    const Placement& place = topology.placement;
    worker_threads = options.resolvedThreadsPerWorker(place.host_workers);
    channel.setOwnCore(parentHasOwnCore(place, worker_threads, availableCores()));
    warnIfReferenceBlas();
    startWorkers();
    parent_share = ParentShare(options.parent_threads, options.keep_parent_memory);
    cursor.started();
  }

  ~Impl() { shutdown(); }

  WeightRule weightRule() const {
    WeightRule rule;
    rule.equal = options.weighting == Weighting::kEqual;
    rule.micro_steps = options.accumulation_steps;
    rule.divided_later = topology.stage->dividesLater();
    return rule;
  }

  // Forks a fresh group of workers and waits until each has set up its replica.
  void startWorkers() {
    processes.killAll();
    processes.clear();
    const int n = options.workers;
    channel.prepareStart({{&map.header().reduced}});
    slots->prepareStart();
    const Placement& place = topology.placement;
    WorkerSetup s;
    s.threads = worker_threads;
    s.segment = &segment;
    s.layout = map.layout;
    s.binding = &binding;
    s.model = &model;
    s.shard = &shard;
    s.options = &options;
    s.weights = weightRule();
    s.start_seq = channel.seq();
    s.parent = ::getpid();
    s.ranks = WorkerRanks{place.worker_offset, place.global_workers, place.node, place.nodes};
    s.buckets = &stage().buckets();
    for (int r = 0; r < n; ++r) {
      s.rank = r;
      s.range = ranges[r];
      processes.spawn([s] { return workerMain(s); });
    }
    channel.await(map.header().reduced, options.step_timeout, Awaited{});
    for (int r = 0; r < n; ++r) {
      if (slots->ok(r)) continue;
      const std::string said = slots->message(r);
      channel.fail<WorkerFailed>(r, fmt::format("gradagg: worker {} failed to start: {}", r, said),
                                 said);
    }
    channel.started();
  }

  void verifyModel() {
    binding.verify();
    if (!options.check_parameter_list || !model.current_parameters) return;
    const auto now = model.current_parameters();
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

  const StepReport& step(const std::optional<BatchPosition>& at, const Message& m) {
    cursor.takeLoad(steps_done, options, topology.placement.nodes);
    cursor.check(at, steps_done);
    step_at = at;
    const StepReport& r = step(m);
    cursor.stepped(at);
    return r;
  }

  const StepReport& step(const Message& m) {
    if (!channel.usable())
      throw NotUsable("gradagg: the aggregator is not usable: " + channel.unusableReason());
    message->write(m);  // a redone step finds it there as it is
    for (;;) {
      if (!channel.usable())
        throw NotUsable("gradagg: the aggregator is not usable: " + channel.unusableReason());
      try {
        return runStep();
      } catch (const WorkerDied& e) {
        if (!restart()) errors->rethrowWithHint(e);
      } catch (const StepTimeout&) {
        if (!restart()) throw;
      } catch (const NodeFailed& e) {
        channel.stop(e.what());  // the other nodes have gone their way: this one cannot go on
        throw;
      }
    }
  }

  bool restart() {
    if (peers_saw_failure || report.restarts >= options.max_restarts) return false;
    ++report.restarts;
    startWorkers();
    return true;
  }

  // Publish: the fields of the step's command, then the command itself.
  void command(Command c) {
    Header& h = map.header();
    h.command = static_cast<std::uint32_t>(c);
    h.step = steps_done;
    h.epoch = step_at ? step_at->epoch : -1;
    h.batch_index = step_at ? step_at->index : -1;
    h.training = !model.is_training || model.is_training() ? 1 : 0;
    h.result_index = static_cast<std::uint32_t>(results.fresh());
    h.command_ns = nowNs();
    for (int b = 0; b < stage().buckets().early(); ++b)
      h.bucket_lines[b].store(static_cast<std::uint32_t>(options.workers),
                              std::memory_order_relaxed);
    channel.command({{&h.computed, /*closed=*/true}, {&h.reduced}});
  }

  const StepReport& runStep() {
    StepTimes times;
    times.begin = Clock::now();
    verifyModel();
    // A step redone here with fresh workers (restart()) is one step to the
    // other nodes, which ran its collectives once: the checksum is not asked
    // of them again.
    if (before_step_ran != steps_done) {
      stage().beforeStep(steps_done);
      before_step_ran = steps_done;
    }
    times.command = Clock::now();  // all the workers' step lies after it
    command(Command::kStep);
    // The step's deadline counts from here, after command()'s wake-up system
    // call: a stop signal (a suspended job) delivered on its return is not
    // time the workers had.
    const auto commanded = Clock::now();
    try {
      sendEarlyBuckets(commanded);
      channel.await(map.header().reduced, options.step_timeout, Awaited{"step", steps_done},
                    commanded);
    } catch (...) {
      finishForPeers();
      throw;
    }
    times.reduced = Clock::now();
    LocalOutcome local = slots->collect(any_grad);
    if (identical_checks < kIdenticalChecks && !warned_identical && local.failed < 0 &&
        local.non_finite < 0) {
      ++identical_checks;
      warnIfIdentical();
    }
    std::string metric_error;
    if (!local.totals.failed) metric_error = metrics->collect(local.totals);
    local.totals.failed = local.totals.failed || !metric_error.empty();
    const auto stage_begin = Clock::now();
    const StepTotals all = stage().reduce(local.totals, any_grad, results.fresh());
    times.stage_ms = millisSince(stage_begin);
    if (local.failed >= 0) throw errors->workerFailed(local.failed, steps_done);
    if (!metric_error.empty())
      throw InvalidArgument(fmt::format("gradagg: step {}: {}", steps_done, metric_error));
    if (all.failed) throw errors->elsewhere("a worker on another node failed", steps_done, "");
    if (all.non_finite) return skipOrRaise(local.non_finite, all, times);
    if (all.weight_total == 0)
      throw InvalidArgument(fmt::format(
          "gradagg: in step {} every worker{} returned 0 samples: there is nothing to average; "
          "nothing was changed",
          steps_done, topology.placement.global_workers > options.workers ? " of every node" : ""));
    // The stage's last collective, before anything the user sees changes.
    if (options.buffers == BufferSync::kFromRank0) stage().shareFirstBuffers(map.slotBuffers(0));
    report.consecutive_skips = 0;
    report.skipped = false;
    apply->gradients(results.fresh(), any_grad);
    results.flip();
    apply->buffers();
    apply->report(report, steps_done, all, times);
    metrics->report(all, report);
    ++steps_done;
    return report;
  }

  // Misuse that trains silently: every worker computed on the same batch. It
  // shows from the first steps; checked on those only (a gradient with a long
  // run of zeros would make every step's memcmp long).
  static constexpr int kIdenticalChecks = 10;
  void warnIfIdentical() {
    if (!slots->identicalGradients()) return;
    warned_identical = true;
    fmt::print(stderr,
               "gradagg: warning: in step {} every worker's gradient was the same, bit for bit: "
               "they most likely read the same batch. A DataLoader or iterator of the parent "
               "read inside the shard function gives each worker its forked copy's next batch; "
               "pick each worker's part by ctx (gradagg::data::ShardedBatches, "
               "gradagg.data.ShardedBatches). Said once.\n",
               steps_done);
    std::fflush(stderr);
  }

  // Early buckets (step/buckets.h), in order: once every worker has taken
  // bucket b's line, sum it over the slots into the fresh result and hand it
  // to the stage.
  void sendEarlyBuckets(Clock::time_point since) {
    const BucketPlan& buckets = stage().buckets();
    const int fresh = results.fresh();
    for (int b = 0; b < buckets.early(); ++b) {
      channel.await(map.header().bucket_lines[b], options.step_timeout,
                    Awaited{"step", steps_done, "its early buckets"}, since);
      early_sum->reduceEarly(buckets.ranges[b], fresh, b == 0);
      stage().sendEarly(b, fresh, map.header().computed.load(std::memory_order_relaxed) > 0);
    }
  }

  // A wait for the workers failed (one died or is late) after early buckets
  // went: the other groups are inside this step's collectives. Finish them
  // with a failed status, so they refuse the step instead of waiting for
  // buckets that will not come, and do not redo the step here with fresh workers.
  void finishForPeers() noexcept {
    if (stage().earlySent() == 0) return;
    peers_saw_failure = true;
    StepTotals failed;
    failed.failed = true;
    try {
      std::fill(any_grad.begin(), any_grad.end(), 0);
      stage().reduce(failed, any_grad, results.fresh());
    } catch (...) {  // the other groups are gone too: the first error says more
    }
  }

  // A non-finite gradient in worker `r` (or, r < 0, on another node).
  const StepReport& skipOrRaise(int r, const StepTotals& all, const StepTimes& times) {
    const bool skip = options.non_finite == NonFinitePolicy::kSkipStep;
    if (skip && report.consecutive_skips < options.max_consecutive_skips) {
      apply->clearGradients();
      ++report.consecutive_skips;
      ++report.skipped_total;
      report.skipped = true;
      apply->report(report, steps_done, all, times);
      metrics->report(all, report);
      ++steps_done;
      return report;
    }
    const std::string why =
        skip ? fmt::format("; {} consecutive steps were skipped already (max_consecutive_skips)",
                           report.consecutive_skips)
             : "";
    if (r < 0) throw errors->elsewhere("a non-finite gradient on another node", steps_done, why);
    const int k = slots->badParam(r);
    const std::string param = k >= 0 ? binding.params()[k].name : "";
    const std::string said = slots->message(r);
    throw NonFiniteGradient(
        fmt::format("gradagg: worker {} in step {}: {}{}", r, steps_done, said, why), r,
        Phase::kWritingSlot, said, param);
  }

  // Stops the workers; the parent's threads and heap as they were.
  void shutdown() noexcept {
    channel.shutdown([this] { command(Command::kStop); }, options.shutdown_timeout);
    parent_share = ParentShare();
  }
};

Aggregator::Aggregator(ModelView model, ShardFn shard, Options options)
    : impl_(std::make_unique<Impl>(std::move(model), std::move(shard), std::move(options))) {}
Aggregator::Aggregator(torch::nn::Module& model, ShardFn shard, Options options)
    : Aggregator(viewOf(model), std::move(shard), std::move(options)) {}
Aggregator::~Aggregator() = default;
Aggregator::Aggregator(Aggregator&&) noexcept = default;
Aggregator& Aggregator::operator=(Aggregator&&) noexcept = default;

const StepReport& Aggregator::step() {
  static const Message kNone;
  return step(kNone);
}
const StepReport& Aggregator::step(const Message& message) {
  if (!impl_) throw NotUsable("gradagg: the aggregator was moved from");
  return impl_->step(std::nullopt, message);
}
const StepReport& Aggregator::step(const BatchPosition& position) {
  static const Message kNone;
  return step(position, kNone);
}
const StepReport& Aggregator::step(const BatchPosition& position, const Message& message) {
  if (!impl_) throw NotUsable("gradagg: the aggregator was moved from");
  return impl_->step(position, message);
}
BatchPosition Aggregator::position() const noexcept {
  if (!impl_) return {};
  try {
    if (const auto r = impl_->cursor.pending(impl_->steps_done, impl_->options,
                                             impl_->topology.placement.nodes))
      return r->position;
  } catch (...) {
  }
  return impl_->cursor.position();
}
void Aggregator::shutdown() {
  if (impl_) impl_->shutdown();
}
bool Aggregator::usable() const noexcept { return impl_ && impl_->channel.usable(); }
int Aggregator::workers() const noexcept { return impl_ ? impl_->options.workers : 0; }
// A checkpoint loaded into the model since the last step counts already.
std::int64_t Aggregator::stepsDone() const noexcept {
  if (!impl_) return 0;
  try {
    if (const auto r = impl_->cursor.pending(impl_->steps_done, impl_->options,
                                             impl_->topology.placement.nodes))
      return r->step;
  } catch (...) {  // a lock that cannot be taken: the last step's count
  }
  return impl_->steps_done;
}
const Options& Aggregator::options() const noexcept {
  static const Options kMovedFrom;  // a moved-from Aggregator has none of its own
  return impl_ ? impl_->options : kMovedFrom;
}
int Aggregator::threadsPerWorker() const { return impl_ ? impl_->worker_threads : 0; }
std::vector<int> Aggregator::workerPids() const {
  if (!impl_ || !impl_->channel.usable()) return {};
  return impl_->processes.pids();
}

}  // namespace gradagg
