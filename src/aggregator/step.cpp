// The parent side of the step protocol (Aggregator::Impl, aggregator_impl.h).
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
//   4. collect, reduce, judge (step/outcome.h): the parent reads what its
//      workers contributed, the ReductionStage the topology gave
//      (step/stage.h) combines it with the other groups', if any, and the
//      verdict says whether the step goes through;
//   5. apply: the parameters' .grad move to the new result (or become undefined
//      where no worker produced a gradient); buffers follow Options::buffers.
// Nothing the user can see changes before step 5, so a failed step changes
// nothing: not the parameters, not .grad, not the buffers. Every failure goes
// through the control channel's policy (runtime/control.h): one that stops the
// workers names the worker and leaves the aggregator unusable.
#include <cstdio>
#include <optional>

#include <fmt/format.h>

#include <gradagg/errors.h>

#include "aggregator/aggregator_impl.h"

namespace gradagg {

using namespace detail;

void Aggregator::Impl::verifyModel() {
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

const StepReport& Aggregator::Impl::step(const std::optional<BatchPosition>& at, const Message& m) {
  cursor.takeLoad(steps_done, options, topology.placement.nodes);
  cursor.check(at, steps_done);
  step_at = at;
  const StepReport& r = step(m);
  cursor.stepped(at);
  return r;
}

const StepReport& Aggregator::Impl::step(const Message& m) {
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

bool Aggregator::Impl::restart() {
  if (peers_saw_failure || report.restarts >= options.max_restarts) return false;
  ++report.restarts;
  startWorkers();
  return true;
}

void Aggregator::Impl::command(Command c) {
  Header& h = map.header();
  h.command = static_cast<std::uint32_t>(c);
  h.step = steps_done;
  h.epoch = step_at ? step_at->epoch : -1;
  h.batch_index = step_at ? step_at->index : -1;
  h.training = !model.is_training || model.is_training() ? 1 : 0;
  h.result_index = static_cast<std::uint32_t>(results.fresh());
  h.command_ns = nowNs();
  for (int b = 0; b < stage().buckets().early(); ++b)
    h.bucket_lines[b].store(static_cast<std::uint32_t>(options.workers), std::memory_order_relaxed);
  channel.command({{&h.computed, /*closed=*/true}, {&h.reduced}});
}

const StepReport& Aggregator::Impl::runStep() {
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
  const Contribution local = collect();
  const auto stage_begin = Clock::now();
  const Reduced all = stage().reduce(local, results.fresh());
  times.stage_ms = millisSince(stage_begin);
  switch (judge(local, all)) {
    case Verdict::kWorkerFailed:
      throw errors->workerFailed(local.failed_rank, steps_done);
    case Verdict::kMetricsDiffer:
      throw InvalidArgument(fmt::format("gradagg: step {}: {}", steps_done, local.metric_error));
    case Verdict::kFailedElsewhere:
      throw errors->elsewhere("a worker on another node failed", steps_done, "");
    case Verdict::kNonFinite:
      return skipOrRaise(local.non_finite_rank, all, times);
    case Verdict::kNoSamples:
      throw InvalidArgument(fmt::format(
          "gradagg: in step {} every worker{} returned 0 samples: there is nothing to average; "
          "nothing was changed",
          steps_done, topology.placement.global_workers > options.workers ? " of every node" : ""));
    case Verdict::kApply:
      break;
  }
  // The stage's last collective, before anything the user sees changes.
  const std::byte* first = map.slotBuffers(0);
  if (options.buffers == BufferSync::kFromRank0) first = stage().firstBuffers(first);
  report.consecutive_skips = 0;
  report.skipped = false;
  apply->gradients(all);
  results.flip();
  apply->buffers(first);
  apply->report(report, steps_done, all, times);
  metrics->report(all.sums.metrics, report);
  ++steps_done;
  return report;
}

Contribution Aggregator::Impl::collect() {
  Contribution local = slots->collect(row_map);
  if (identical_checks < kIdenticalChecks && !warned_identical && !local.failed() &&
      !local.nonFinite()) {
    ++identical_checks;
    warnIfIdentical();
  }
  if (local.failed()) return local;
  MetricBook::Collected m = metrics->collect();
  local.sums.metrics = m.sums;
  local.metric_error = std::move(m.error);
  return local;
}

void Aggregator::Impl::warnIfIdentical() {
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

void Aggregator::Impl::sendEarlyBuckets(Clock::time_point since) {
  const BucketPlan& buckets = stage().buckets();
  const int fresh = results.fresh();
  for (int b = 0; b < buckets.early(); ++b) {
    channel.await(map.header().bucket_lines[b], options.step_timeout,
                  Awaited{"step", steps_done, "its early buckets"}, since);
    early_sum->reduceEarly(buckets.ranges[b], fresh, b == 0);
    stage().sendEarly(b, fresh, map.header().computed.load(std::memory_order_relaxed) > 0);
  }
}

void Aggregator::Impl::finishForPeers() noexcept {
  if (stage().earlySent() == 0) return;
  peers_saw_failure = true;
  try {
    Contribution abandoned;
    abandoned.abandoned = true;
    stage().reduce(abandoned, results.fresh());
  } catch (...) {  // the other groups are gone too: the first error says more
  }
}

const StepReport& Aggregator::Impl::skipOrRaise(int r, const Reduced& all, const StepTimes& times) {
  const bool skip = options.non_finite == NonFinitePolicy::kSkipStep;
  if (skip && report.consecutive_skips < options.max_consecutive_skips) {
    apply->clearGradients();
    ++report.consecutive_skips;
    ++report.skipped_total;
    report.skipped = true;
    apply->report(report, steps_done, all, times);
    metrics->report(all.sums.metrics, report);
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

}  // namespace gradagg
