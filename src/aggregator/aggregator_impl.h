// Aggregator::Impl: the parent's state, shared by its two halves:
// aggregator.cpp (construction, the workers' start, shutdown, the public
// calls) and step.cpp (the step protocol). Private to src/aggregator/.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <gradagg/aggregator.h>

#include "aggregator/apply.h"
#include "aggregator/run_cursor.h"
#include "aggregator/step_errors.h"
#include "model/model_binding.h"
#include "runtime/control.h"
#include "runtime/parent_share.h"
#include "runtime/process.h"
#include "runtime/segment.h"
#include "step/layout.h"
#include "step/message.h"
#include "step/metrics.h"
#include "step/outcome.h"
#include "step/reduce_scatter.h"
#include "step/slots.h"
#include "topology/topology.h"

namespace gradagg {

struct Aggregator::Impl {
  // Declaration order is destruction order reversed: workers go first, then the
  // stage (its sender thread), then the model gets its memory back, then the
  // segment is unmapped.
  Options options;
  ModelView model;
  ShardFn shard;
  detail::Segment segment;
  detail::ModelBinding binding;
  detail::Topology topology;  // where the workers sit, and the reduction's second stage
  detail::SegmentMap map;
  std::optional<detail::ReduceScatter> early_sum;  // the parent's sums of early buckets
  std::optional<detail::SlotReader> slots;
  std::optional<detail::MessageWriter> message;
  std::optional<detail::MetricBook> metrics;
  std::optional<detail::StepErrors> errors;
  std::vector<detail::ByteRange> ranges;           // worker r reduces ranges[r]
  std::vector<const c10::TensorImpl*> param_list;  // model.parameters() at construction
  std::unique_ptr<detail::Applier> apply;
  detail::ProcessSet processes;
  detail::ParentChannel channel;
  detail::ParentShare parent_share;  // the parent's threads and heap, restored at the end
  int worker_threads = 1;  // intra-op threads per worker (the topology knows who shares the cores)

  std::int64_t steps_done = 0;
  // The step whose stage().beforeStep ran: once per step, not once per try.
  std::int64_t before_step_ran = -1;
  detail::RunCursor cursor;              // the data's position; checkpoints' loads
  std::optional<BatchPosition> step_at;  // the position of the step being run, if any
  int identical_checks = 0;              // steps checked for identical gradients
  // Early buckets were sent when a wait for the workers failed: the other
  // groups saw the step fail, so this one cannot redo it with fresh workers.
  bool peers_saw_failure = false;
  bool warned_identical = false;  // identical gradients were said (once per Aggregator)
  detail::RowMap row_map;         // where each parameter's rows lie in a slot's rows
  detail::ResultPair results;
  StepReport report;

  detail::ReductionStage& stage() { return *topology.stage; }

  // Construction and shutdown (aggregator.cpp).
  Impl(ModelView m, ShardFn fn, Options opts);
  ~Impl() { shutdown(); }
  detail::WeightRule weightRule() const;
  // Forks a fresh group of workers and waits until each has set up its replica.
  void startWorkers();
  // Stops the workers; the parent's threads and heap as they were.
  void shutdown() noexcept;

  // The step (step.cpp). A step at a data position: the cursor's checks around step(m).
  const StepReport& step(const std::optional<BatchPosition>& at, const Message& m);
  // The step, redone with fresh workers while Options::max_restarts allows.
  const StepReport& step(const Message& m);
  bool restart();
  // The model's tensors are where the workers were forked with them.
  void verifyModel();

  // Publish: the fields of the step's command, then the command itself.
  void command(detail::Command c);

  // One try of the step: publish, compute, reduce, then collect, reduce, judge, apply.
  const StepReport& runStep();

  // The collect phase (step/outcome.h): what this group's workers left, with
  // their metrics when none failed.
  detail::Contribution collect();

  // Misuse that trains silently: every worker computed on the same batch. It
  // shows from the first steps; checked on those only (a gradient with a long
  // run of zeros would make every step's memcmp long).
  static constexpr int kIdenticalChecks = 10;
  void warnIfIdentical();

  // Early buckets (step/buckets.h), in order: once every worker has taken
  // bucket b's line, sum it over the slots into the fresh result and hand it
  // to the stage.
  void sendEarlyBuckets(detail::Clock::time_point since);

  // A wait for the workers failed (one died or is late) after early buckets
  // went: the other groups are inside this step's collectives. Finish them
  // with a failed status, so they refuse the step instead of waiting for
  // buckets that will not come, and do not redo the step here with fresh workers.
  void finishForPeers() noexcept;

  // A non-finite gradient in worker `r` (or, r < 0, on another node).
  const StepReport& skipOrRaise(int r, const detail::Reduced& all, const detail::StepTimes& times);
};

}  // namespace gradagg
