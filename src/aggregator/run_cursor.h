// Where an Aggregator's run is in its data, and what a checkpoint's load says
// about it (model/resumed.h): the data's next batch (Aggregator::position),
// the checks of step(position), and taking a load at construction or before a
// step. The global step itself stays the Aggregator's (steps_done); the cursor
// reads it and, on a load, sets it.
#pragma once

#include <cstdint>
#include <optional>

#include <gradagg/model.h>
#include <gradagg/options.h>
#include <gradagg/shard.h>

#include "model/resumed.h"

namespace gradagg::detail {

class RunCursor {
 public:
  // Before the Aggregator's seed is resolved: a load into `model` gives
  // options.start_step (another value than the checkpoint's is an
  // InvalidArgument) and the position. The note stays until started().
  void start(const ModelView& model, Options& options);
  // The Aggregator is made: the load taken in start() is gone.
  void started() const;

  // Before each step: a load since the last step sets `steps_done` and the
  // position; InvalidArgument (nothing changed, the note stays) where this
  // run cannot be the checkpoint's: across `nodes` > 1, or another torch seed.
  void takeLoad(std::int64_t& steps_done, const Options& options, int nodes);
  // That load, if it would be taken (for stepsDone() and position() at once).
  std::optional<Resumed> pending(std::int64_t steps_done, const Options& options, int nodes) const;

  // step(at)'s checks, before anything runs: InvalidArgument for a negative
  // position, one before position(), or any after a resume from a checkpoint
  // saved without a position.
  void check(const std::optional<BatchPosition>& at, std::int64_t steps_done) const;
  // A step went through (skipped ones included).
  void stepped(const std::optional<BatchPosition>& at);

  BatchPosition position() const { return position_; }

 private:
  void resumeAt(const Resumed& resumed);
  bool refused(const Resumed& r, std::int64_t steps_done, const Options& options, int nodes) const;

  const ModelView* model_ = nullptr;
  BatchPosition position_;         // the data's next batch
  bool from_checkpoint_ = false;   // position_ is a checkpoint's; no step since
  bool without_position_ = false;  // resumed from a step > 0 saved at {0, 0}
  bool seed_from_torch_ = false;   // Options::seed was unset: the parent's torch seed
};

}  // namespace gradagg::detail
