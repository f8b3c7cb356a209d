// What a checkpoint's load told about a model: the global step and data
// position its parameters now hold. Checkpoint::load (C++) and
// gradagg.Checkpoint.load (Python) note it when they load an optimizer too (a
// resume; loading weights alone is an initialisation); an Aggregator of that
// model takes it when it is made (Options::start_step) and before each step (a
// load after it was made), so a resumed run cannot go on from another step by
// mistake. Keyed by the whole list of the model's parameters and buffers
// (TensorImpls, which keep their identity when the Aggregator moves them into
// shared memory), so a load into a part of the model (a backbone) is not the
// whole model's; held weakly: a note about a model that is gone is dropped.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <gradagg/model.h>
#include <gradagg/shard.h>

namespace gradagg::detail {

struct Resumed {
  std::int64_t step = 0;
  BatchPosition position;
  std::string path;  // the checkpoint, for errors
  // The parent's torch seed after the load (the checkpoint's), set by noteResumed.
  std::uint64_t seed = 0;
};

// Replaces an earlier note about the same model.
void noteResumed(const ModelView& model, Resumed resumed);
// The note about `model`, removed; nullopt when there is none.
std::optional<Resumed> takeResumed(const ModelView& model);
// The same, left in place (an Aggregator takes it once it is made).
std::optional<Resumed> peekResumed(const ModelView& model);

}  // namespace gradagg::detail
