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
//      not view); set `computed` to N + 1 and `reduced` to N; bump command_seq;
//      wake (the control channel's command);
//   2. compute: each worker loads the snapshot, runs the shard function and
//      backward into its slot, and arrives on `computed`; the last to arrive
//      (the closer) writes the step's weights and summary once for everyone;
//   3. reduce: then each worker sums its range of the flat gradient over all
//      slots, in rank order, into the result, and arrives on `reduced`.
//      The parent waits on `reduced` with a deadline, checking every slice that
//      each worker is alive;
//   4. second stage: across nodes the node parents combine their totals and
//      results (src/multinode); on one node there is nothing to do;
//   5. apply: the parameters' .grad move to the new result (or become undefined
//      where no worker produced a gradient); buffers follow Options::buffers.
// Nothing the user can see changes before step 5, so a failed step changes
// nothing: not the parameters, not .grad, not the buffers. Every failure goes
// through the control channel's policy (src/core/control.h): one that stops the
// workers names the worker and leaves the aggregator unusable.
#include <gradagg/aggregator.h>

#include <unistd.h>

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <gradagg/errors.h>

#include "aggregator/apply.h"
#include "aggregator/worker.h"
#include "core/buckets.h"
#include "core/control.h"
#include "core/layout.h"
#include "core/model_binding.h"
#include "core/process.h"
#include "core/reduce.h"
#include "core/segment.h"
#include "core/stage.h"
#include "multinode/cross_node.h"

namespace gradagg {

using namespace detail;

namespace {
std::vector<FlatTensor> flatParams(const ModelBinding& binding) {
  std::vector<FlatTensor> flat;
  for (const TensorEntry& p : binding.params())
    flat.push_back(FlatTensor{p.offset, static_cast<std::uint64_t>(p.tensor.numel()),
                              elementTypeOf(p.dtype), p.requires_grad});
  return flat;
}

std::vector<WorkerWords> workerWords(const SegmentMap& map, int workers) {
  std::vector<WorkerWords> words;
  for (int r = 0; r < workers; ++r)
    words.push_back({&map.control(r).phase, &map.control(r).done_seq});
  return words;
}
}  // namespace

struct Aggregator::Impl {
  // Declaration order is destruction order reversed: workers go first, then the
  // model gets its memory back, then the segment is unmapped.
  Options options;
  ModelView model;
  ShardFn shard;
  Segment segment;
  ModelBinding binding;
  SegmentMap map;
  std::vector<FlatTensor> flat;                    // the parameters as the reduction sees them
  BucketPlan buckets;                              // across nodes: how the gradient crosses
  std::vector<ByteRange> ranges;                   // worker r reduces ranges[r]
  std::vector<const c10::TensorImpl*> param_list;  // model.parameters() at construction
  std::unique_ptr<ReductionStage> stage;           // the second stage: LocalStage or CrossNode
  std::unique_ptr<Applier> apply;
  ProcessSet processes;
  ParentChannel channel;
  int saved_parent_threads = 0;  // to restore, when options.parent_threads > 0
  int worker_threads = 1;        // intra-op threads per worker (the stage knows who shares the cores)

  std::int64_t steps_done = 0;
  // Early buckets were sent when a wait for the workers failed: the other nodes
  // saw the step fail, so this one cannot redo it with fresh workers.
  bool peers_saw_failure = false;
  std::vector<std::int64_t> early_samples;  // per worker, for the early buckets' weights
  std::vector<double> early_weights;
  std::vector<const std::byte*> slots;  // every slot's gradient area
  ResultPair results;
  StepReport report;

  Impl(ModelView m, ShardFn fn, Options opts)
      : options((opts.validate(), std::move(opts))),
        model(std::move(m)),
        shard(std::move(fn)),
        binding(model) {
    if (!shard) throw InvalidArgument("shard function: expected a callable, got an empty ShardFn");
    const int n = options.workers;
    const Layout layout = Layout::plan(binding.sizes(n), pageBytes());
    segment = Segment::createAnonymous(layout.segment_bytes);
    initHeader(segment.base(), layout, pageBytes());
    map = SegmentMap{segment.base(), layout};
    binding.adopt(map.snapshotParams(), map.snapshotBuffers(), segment.base(),
                  segment.base() + segment.size());
    flat = flatParams(binding);
    if (options.nodes.nodes > 1)
      buckets = planBuckets(binding, options.nodes.first_bucket_bytes, options.nodes.bucket_bytes,
                            options.nodes.overlap);
    ranges = splitRanges(buckets.tail(layout.sizes.param_bytes), n);
    for (int r = 0; r < n; ++r) slots.push_back(map.slot(r));
    early_samples.resize(n);
    early_weights.resize(n);
    if (model.current_parameters)
      for (const auto& p : model.current_parameters())
        param_list.push_back(p.unsafeGetTensorImpl());
    report.workers.resize(n);
    apply = std::make_unique<Applier>(binding, map, options);
    if (options.nodes.nodes > 1)  // refuses bf16 and fp16 parameters before its rendezvous
      stage = std::make_unique<CrossNode>(options.nodes, options.buffers, binding, map, n, buckets);
    else
      stage = std::make_unique<LocalStage>(n);
    channel = ParentChannel(map.header().command_seq, workerWords(map, n), processes,
                            ChannelNames{"worker", "workers", Phase::kReducing});
    worker_threads = options.resolvedThreadsPerWorker(stage->placement().host_workers);
    channel.setOwnCore(parentHasOwnCore(stage->placement(), worker_threads, availableCores()));
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

  // Forks a fresh group of workers and waits until each has set up its replica.
  void startWorkers() {
    processes.killAll();
    processes.clear();
    const int n = options.workers;
    channel.prepareStart({{&map.header().reduced}});
    for (int r = 0; r < n; ++r) {
      WorkerControl& c = map.control(r);
      c.status = static_cast<std::uint32_t>(SlotStatus::kOk);
      c.message[0] = '\0';
    }
    WorkerSetup s;
    s.threads = worker_threads;
    s.segment = &segment;
    s.layout = map.layout;
    s.binding = &binding;
    s.model = &model;
    s.shard = &shard;
    s.options = &options;
    s.flat = &flat;
    s.start_seq = channel.seq();
    s.parent = ::getpid();
    s.placement = stage->placement();
    s.buckets = &buckets;
    for (int r = 0; r < n; ++r) {
      s.rank = r;
      s.range = ranges[r];
      processes.spawn([s] { return workerMain(s); });
    }
    channel.await(map.header().reduced, options.step_timeout, Awaited{});
    for (int r = 0; r < n; ++r) {
      if (map.control(r).status != static_cast<std::uint32_t>(SlotStatus::kOk))
        channel.fail<WorkerFailed>(
            r, fmt::format("gradagg: worker {} failed to start: {}", r, map.control(r).message),
            std::string(map.control(r).message));
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

  const StepReport& step() {
    for (;;) {
      if (!channel.usable())
        throw NotUsable("gradagg: the aggregator is not usable: " + channel.unusableReason());
      try {
        return runStep();
      } catch (const WorkerDied&) {
        if (!restart()) throw;
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
    h.training = !model.is_training || model.is_training() ? 1 : 0;
    h.result_index = static_cast<std::uint32_t>(results.fresh());
    h.command_ns = nowNs();
    for (int b = 0; b < buckets.early(); ++b)
      h.bucket_lines[b].store(static_cast<std::uint32_t>(options.workers), std::memory_order_relaxed);
    channel.command({{&h.computed, /*closed=*/true}, {&h.reduced}});
  }

  const StepReport& runStep() {
    StepTimes times;
    times.begin = Clock::now();
    verifyModel();
    stage->beforeStep(steps_done);
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
    const LocalOutcome local = apply->collect();
    const auto stage_begin = Clock::now();
    const StepTotals all = stage->reduce(local.totals, apply->flags(), results.fresh());
    times.node_ms = millisSince(stage_begin);
    if (local.failed >= 0) throw workerFailed(local.failed);
    if (all.failed)
      throw NodeFailed(fmt::format("gradagg: a worker on another node failed in step {}; no "
                                   "node applied the step (this is node {})",
                                   steps_done, stage->placement().node),
                       stage->placement().node);
    if (all.non_finite) return skipOrRaise(local.non_finite, all, times);
    report.consecutive_skips = 0;
    report.skipped = false;
    apply->gradients(results.fresh());
    results.flip();
    apply->buffers();
    apply->report(report, steps_done, all, times);
    ++steps_done;
    return report;
  }

  // Early buckets (core/buckets.h), in order: once every worker has taken
  // bucket b's line, sum it over the slots into the fresh result with the
  // weights the workers' reduction would use, and hand it to the stage.
  void sendEarlyBuckets(Clock::time_point since) {
    const int early = buckets.early();
    const int n = options.workers;
    const bool equal = options.weighting == Weighting::kEqual;
    const int fresh = results.fresh();
    for (int b = 0; b < early; ++b) {
      channel.await(map.header().bucket_lines[b], options.step_timeout,
                    Awaited{"step", steps_done, "its early buckets"}, since);
      if (b == 0) {
        for (int r = 0; r < n; ++r) early_samples[r] = map.control(r).samples;
        computeWeights(equal, early_samples.data(), n, early_weights.data(),
                       stage->placement().normalize);
        for (int r = 0; r < n; ++r)
          early_weights[r] =
              slotWeight(early_weights[r], equal, options.accumulation_steps, early_samples[r]);
      }
      reduceRange(flat, buckets.ranges[b], map.result(fresh), slots.data(), early_weights.data(),
                  n);
      stage->sendEarly(b, fresh, map.header().computed.load(std::memory_order_relaxed) > 0);
    }
  }

  // A wait for the workers failed (one died or is late) after early buckets
  // went: the other nodes are inside this step's collectives. Finish them with
  // a failed status, so they refuse the step instead of waiting for buckets
  // that will not come, and do not redo the step here with fresh workers.
  void finishForPeers() noexcept {
    if (stage->earlySent() == 0) return;
    peers_saw_failure = true;
    StepTotals failed;
    failed.failed = true;
    try {
      std::vector<std::uint8_t> none(binding.params().size(), 0);
      stage->reduce(failed, none, results.fresh());
    } catch (...) {  // the other nodes are gone too: the first error says more
    }
  }

  WorkerFailed workerFailed(int r) {
    const WorkerControl& c = map.control(r);
    const auto phase = static_cast<Phase>(c.failed_phase);
    return WorkerFailed(fmt::format("gradagg: worker {} failed in phase '{}' of step {}: {}", r,
                                    phaseName(phase), steps_done, c.message),
                        r, phase, c.message);
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
      ++steps_done;
      return report;
    }
    const std::string why =
        skip ? fmt::format("; {} consecutive steps were skipped already (max_consecutive_skips)",
                           report.consecutive_skips)
             : "";
    const int node = stage->placement().node;
    if (r < 0)
      throw NodeFailed(fmt::format("gradagg: a non-finite gradient on another node in step {}{}; "
                                   "no node applied the step (this is node {})",
                                   steps_done, why, node),
                       node);
    const int k = map.control(r).bad_param;
    const std::string param = k >= 0 ? binding.params()[k].name : "";
    const std::string message = map.control(r).message;
    throw NonFiniteGradient(
        fmt::format("gradagg: worker {} in step {}: {}{}", r, steps_done, message, why), r,
        Phase::kWritingSlot, message, param);
  }

  void shutdown() noexcept {
    channel.shutdown([this] { command(Command::kStop); }, options.shutdown_timeout);
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
  if (!impl_) throw NotUsable("gradagg: the aggregator was moved from");
  return impl_->step();
}
void Aggregator::shutdown() {
  if (impl_) impl_->shutdown();
}
bool Aggregator::usable() const noexcept { return impl_ && impl_->channel.usable(); }
int Aggregator::workers() const noexcept { return impl_ ? impl_->options.workers : 0; }
std::int64_t Aggregator::stepsDone() const noexcept { return impl_ ? impl_->steps_done : 0; }
const Options& Aggregator::options() const noexcept { return impl_->options; }
int Aggregator::threadsPerWorker() const {
  return impl_ ? impl_->worker_threads : 0;
}
std::vector<int> Aggregator::workerPids() const {
  std::vector<int> out;
  if (!impl_ || !impl_->channel.usable()) return out;
  for (std::size_t r = 0; r < impl_->processes.size(); ++r) out.push_back(impl_->processes.pid(r));
  return out;
}

}  // namespace gradagg
