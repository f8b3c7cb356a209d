#include "aggregator/run_cursor.h"

#include <fmt/format.h>

#include <gradagg/errors.h>

namespace gradagg::detail {

void RunCursor::start(const ModelView& model, Options& options) {
  model_ = &model;
  seed_from_torch_ = !options.seed;
  const auto resumed = peekResumed(model);
  if (!resumed) return;
  if (options.start_step != 0 && options.start_step != resumed->step)
    throw InvalidArgument(fmt::format(
        "Options.start_step is {}, but the model was loaded from checkpoint {} at step {}: "
        "leave start_step at 0 (the checkpoint's step is taken) or give the checkpoint's",
        options.start_step, resumed->path, resumed->step));
  options.start_step = resumed->step;
  resumeAt(*resumed);
}

void RunCursor::started() const { takeResumed(*model_); }

void RunCursor::resumeAt(const Resumed& resumed) {
  position_ = resumed.position;
  from_checkpoint_ = true;
  without_position_ = resumed.step > 0 && resumed.position == BatchPosition{};
}

bool RunCursor::refused(const Resumed& r, std::int64_t steps_done, const Options& options,
                        int nodes) const {
  const bool across_nodes = nodes > 1 && (r.step != steps_done || r.position != position_);
  const bool other_seed = seed_from_torch_ && options.seed_workers && r.seed != *options.seed;
  return across_nodes || other_seed;
}

std::optional<Resumed> RunCursor::pending(std::int64_t steps_done, const Options& options,
                                          int nodes) const {
  auto r = peekResumed(*model_);
  if (r && refused(*r, steps_done, options, nodes)) return std::nullopt;
  return r;
}

void RunCursor::takeLoad(std::int64_t& steps_done, const Options& options, int nodes) {
  const auto resumed = peekResumed(*model_);
  if (!resumed) return;
  if (nodes > 1 && (resumed->step != steps_done || resumed->position != position_))
    throw InvalidArgument(fmt::format(
        "gradagg: checkpoint {} (step {}) was loaded into the model of a running Aggregator "
        "at step {} across nodes, where every node must move alike: load it before making "
        "the Aggregator, on every node",
        resumed->path, resumed->step, steps_done));
  if (refused(*resumed, steps_done, options, nodes))
    throw InvalidArgument(fmt::format(
        "gradagg: checkpoint {} (step {}) was loaded into the model of a running Aggregator "
        "whose workers' seed ({}) is not the checkpoint's torch seed ({}): its dropout would "
        "not be the run's; make the Aggregator after the load, or give Options::seed",
        resumed->path, resumed->step, *options.seed, resumed->seed));
  takeResumed(*model_);
  steps_done = resumed->step;
  resumeAt(*resumed);
}

void RunCursor::check(const std::optional<BatchPosition>& at, std::int64_t steps_done) const {
  if (!at) return;
  if (at->epoch < 0 || at->index < 0)
    throw InvalidArgument(
        fmt::format("gradagg: step(position) at batch {} of epoch {}: expected both >= 0",
                    at->index, at->epoch));
  if (*at < position_)
    throw InvalidArgument(fmt::format(
        "gradagg: step(position) at batch {} of epoch {}, but the data are at batch {} of "
        "epoch {} already ({}): a batch is trained once; go on with the ShardedBatches' "
        "steps(epoch, ...) from the aggregator's position",
        at->index, at->epoch, position_.index, position_.epoch,
        from_checkpoint_ ? "the checkpoint this run resumed from" : "the steps this run made"));
  if (without_position_)
    throw InvalidArgument(fmt::format(
        "gradagg: step(position) after a resume from a checkpoint of step {} saved without "
        "the data's position (TrainingState::position left at batch 0 of epoch 0): which "
        "batches that run trained is unknown; save the aggregator's position with the step",
        steps_done));
}

void RunCursor::stepped(const std::optional<BatchPosition>& at) {
  if (at) position_ = at->next();
  from_checkpoint_ = false;
}

}  // namespace gradagg::detail
