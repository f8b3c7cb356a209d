// Sharded batches: the data side of a step, as a pure function of the global
// step and the worker's global rank.
//
// Built once in the parent from a torch::data map-style dataset of known size;
// each worker's shard function asks for its part of the step's global batch:
//
//   gradagg::data::ShardedBatches data(FashionMnist(dir), 64, {.shuffle = true});
//   gradagg::Aggregator agg(model, [&](const gradagg::ShardContext& ctx) {
//     auto batch = data.batch(ctx);                    // loads in the worker
//     auto loss = torch::nll_loss(model->forward(batch.data), batch.target);
//     return gradagg::ShardResult{loss, batch.data.size(0)};
//   }, options);
//   for (auto epoch = state.position.epoch; epoch < epochs; ++epoch) {
//     for (auto position : data.steps(epoch, state.position)) {  // one epoch, as a DataLoader's
//       agg.step(position);
//       opt.step();
//     }
//     scheduler.step();
//   }
//
// The rule (the same as gradagg.data.ShardedBatches in Python, bit for bit):
// epoch e visits the dataset in DistributedSampler's order, torch::randperm(n)
// with a generator seeded seed + e (shuffle), or 0..n-1; its batch i takes the
// i-th batch_size of that order (the last batch of an epoch may be smaller, or
// is dropped with drop_last). A step given a position (step(position)) reads
// that batch; leaving an epoch early does not shift the next one. A step
// without one reads batch step % steps_per_epoch() of epoch step /
// steps_per_epoch(). Global worker g of G takes its
// contiguous part of it, sizes differing by at most one (some may get none: they
// return ShardResult{{}, 0}, or the loss of their 0-row batch with 0 samples);
// with gradient accumulation each worker's part is split again over its micro-
// batches. Weighted by samples (the default), the step's gradient is then the
// mean over the global batch, whatever the number of workers or nodes: one
// process over global_batch(position) computes the same. Nothing is saved: a
// restarted worker, a redone step and a resumed run (TrainingState::position)
// read the same samples.
//
// Do not iterate a torch::data DataLoader of the parent inside the shard function:
// every worker has a forked copy of it and reads the same batch.
//
// The names follow torch::data (snake_case), like the Python class.
#pragma once

#include <cstdint>
#include <future>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#include <ATen/Parallel.h>
#include <torch/data/datasets/base.h>
#include <torch/data/example.h>
#include <torch/data/transforms/stack.h>

#include <gradagg/shard.h>

namespace gradagg::data {

struct ShardedBatchesOptions {
  bool shuffle = false;
  std::uint64_t seed = 0;  // epoch e is shuffled with seed + e
  bool drop_last = false;  // drop an epoch's last, smaller batch
  // Load the next step's part on a loader thread while this one computes (in
  // the workers only; the parent never starts a thread). Same bits either way.
  bool prefetch = false;
};

// The index rule, without the data: which dataset indices a step gives whom.
class BatchPlan {
 public:
  // Throws InvalidArgument for batch_size 0, an empty dataset, or drop_last
  // with fewer samples than one batch.
  BatchPlan(std::size_t dataset_size, std::size_t batch_size, ShardedBatchesOptions options = {});

  std::int64_t steps_per_epoch() const { return steps_per_epoch_; }
  std::int64_t epoch(std::int64_t step) const;
  // The position a step without one reads: {step / steps_per_epoch, step % steps_per_epoch}.
  BatchPosition positionOf(std::int64_t step) const;
  // The positions of `epoch`, in order, from `start` on: all of them when
  // start.epoch < epoch, from start.index when it is `epoch`, none when later.
  std::vector<BatchPosition> steps(std::int64_t epoch, BatchPosition start = {}) const;
  std::size_t dataset_size() const { return size_; }
  std::size_t batch_size() const { return batch_; }
  const ShardedBatchesOptions& options() const { return options_; }

  // The dataset indices of global step `step` for global worker `global_rank`
  // of `global_workers`, micro-batch `micro_step` of `micro_steps`; the
  // defaults give the whole global batch. Not thread-safe (it caches the
  // epoch's order).
  std::vector<std::size_t> indices(std::int64_t step, int global_rank = 0, int global_workers = 1,
                                   int micro_step = 0, int micro_steps = 1) const {
    return indices(positionOf(step), global_rank, global_workers, micro_step, micro_steps);
  }
  // The same at a position; an index outside 0..steps_per_epoch-1 is an InvalidArgument.
  std::vector<std::size_t> indices(const BatchPosition& position, int global_rank = 0,
                                   int global_workers = 1, int micro_step = 0,
                                   int micro_steps = 1) const;
  // ctx's part: at ctx.position when the step has one, else at ctx.step's.
  std::vector<std::size_t> indices(const ShardContext& ctx) const {
    return indices(positionOf(ctx), ctx.global_rank, ctx.global_workers, ctx.micro_step,
                   ctx.micro_steps);
  }
  BatchPosition positionOf(const ShardContext& ctx) const {
    return ctx.position ? *ctx.position : positionOf(ctx.step);
  }
  // How many samples ctx's part has (indices(ctx).size(), without building it).
  std::int64_t samples(const ShardContext& ctx) const;

 private:
  std::pair<std::size_t, std::size_t> part(const BatchPosition& position, int global_rank,
                                           int global_workers, int micro_step,
                                           int micro_steps) const;
  const std::vector<std::int64_t>& order(std::int64_t epoch) const;

  std::size_t size_;
  std::size_t batch_;
  ShardedBatchesOptions options_;
  std::int64_t steps_per_epoch_;
  mutable std::int64_t cached_epoch_ = -1;
  mutable std::vector<std::int64_t> order_;
};

namespace detail {
// A dataset whose get_batch returns a vector of examples is collated with
// torch::data's Stack; one that collates itself (a MapDataset ending in
// .map(Stack<>()), your own BatchDataset) is used as is.
template <typename Batch>
struct Collate {
  using Type = Batch;
  static Batch apply(Batch batch) { return batch; }
};
template <typename Example>
struct Collate<std::vector<Example>> {
  using Type = decltype(std::declval<torch::data::transforms::Stack<Example>&>().apply_batch(
      std::declval<std::vector<Example>>()));
  static Type apply(std::vector<Example> batch) {
    return torch::data::transforms::Stack<Example>().apply_batch(std::move(batch));
  }
};

// An empty part: one sample's batch cut to 0 rows, so that batch.data.size(0)
// is 0 and a forward over it is well formed.
inline torch::data::Example<> noRows(const torch::data::Example<>& one) {
  return {one.data.narrow(0, 0, 0), one.target.narrow(0, 0, 0)};
}
inline torch::data::TensorExample noRows(const torch::data::TensorExample& one) {
  return torch::data::TensorExample(one.data.narrow(0, 0, 0));
}
template <typename T>
std::optional<T> noRows(const T&) {
  return std::nullopt;  // other batch types: the dataset's own get_batch({}) decides
}
}  // namespace detail

// Throws InvalidArgument: a dataset without a size (a stream) cannot be sharded.
[[noreturn]] void throwUnknownSize();

template <typename Dataset>
class ShardedBatches {
 public:
  using Batch = typename detail::Collate<typename Dataset::BatchType>::Type;

  // The dataset must report its size(). Throws InvalidArgument otherwise, and
  // for the cases BatchPlan refuses.
  ShardedBatches(Dataset dataset, std::size_t batch_size, ShardedBatchesOptions options = {})
      : plan_(knownSize(dataset), batch_size, options),
        dataset_(std::move(dataset)),
        parent_(::getpid()) {}
  // A prefetch in flight holds `this`: moving waits for it first. Not noexcept:
  // the wait and the user's Dataset's own move may throw.
  ShardedBatches(ShardedBatches&& other)  // NOLINT(performance-noexcept-move-constructor)
      : plan_((other.drain(), std::move(other.plan_))),
        dataset_(std::move(other.dataset_)),
        parent_(other.parent_) {}
  ShardedBatches& operator=(ShardedBatches&&) = delete;
  ~ShardedBatches() { drain(); }

  std::int64_t steps_per_epoch() const { return plan_.steps_per_epoch(); }
  std::int64_t epoch(std::int64_t step) const { return plan_.epoch(step); }
  // One epoch's steps, as a DataLoader's epoch: for (auto p : data.steps(e)) agg.step(p).
  // From `start` on (a resumed run's TrainingState::position): see BatchPlan::steps.
  std::vector<BatchPosition> steps(std::int64_t epoch, BatchPosition start = {}) const {
    return plan_.steps(epoch, start);
  }
  const BatchPlan& plan() const { return plan_; }
  Dataset& dataset() { return dataset_; }
  std::vector<std::size_t> indices(const ShardContext& ctx) const { return plan_.indices(ctx); }
  std::int64_t samples(const ShardContext& ctx) const { return plan_.samples(ctx); }

  // In the shard function: this worker's samples for ctx.step (and
  // ctx.micro_step), collated; 0 rows when it has none this step.
  Batch batch(const ShardContext& ctx) {
    const BatchPosition at = plan_.positionOf(ctx);
    const Key key{at.epoch,           at.index,       ctx.global_rank,
                  ctx.global_workers, ctx.micro_step, ctx.micro_steps};
    std::optional<Batch> out;
    if (next_.valid()) {
      if (next_key_ == key)
        out.emplace(next_.get());
      else
        next_.wait();  // another step (redone, restarted): load it afresh
      next_ = {};
    }
    if (!out) out.emplace(load(plan_.indices(ctx)));
    if (plan_.options().prefetch && ::getpid() != parent_) prefetchAfter(key);
    return std::move(*out);
  }
  // The whole global batch of `step` (or of a position), collated: a
  // one-process run over it computes what gradagg's workers compute together.
  Batch global_batch(std::int64_t step) { return load(plan_.indices(step)); }
  Batch global_batch(const BatchPosition& position) { return load(plan_.indices(position)); }

 private:
  struct Key {
    std::int64_t epoch, index;
    int rank, workers, micro, micros;
    bool operator==(const Key& o) const {
      return epoch == o.epoch && index == o.index && rank == o.rank && workers == o.workers &&
             micro == o.micro && micros == o.micros;
    }
  };

  static std::size_t knownSize(const Dataset& dataset);
  void drain() {
    if (next_.valid()) next_.wait();
    next_ = {};
  }

  Batch load(const std::vector<std::size_t>& indices) {
    if (indices.empty()) {
      const std::size_t first[1] = {0};
      auto rows = detail::noRows(
          detail::Collate<typename Dataset::BatchType>::apply(dataset_.get_batch(first)));
      if constexpr (std::is_same_v<decltype(rows), Batch>)
        return rows;
      else if (rows)
        return std::move(*rows);
    }
    return detail::Collate<typename Dataset::BatchType>::apply(dataset_.get_batch(indices));
  }

  // A guess: the next micro-batch, else the next batch of the epoch, else the
  // next epoch's first. A step that reads another loads afresh.
  void prefetchAfter(const Key& key) {
    next_key_ = key;
    if (++next_key_.micro == key.micros) {
      next_key_.micro = 0;
      if (++next_key_.index == plan_.steps_per_epoch()) {
        next_key_.index = 0;
        ++next_key_.epoch;
      }
    }
    auto indices = plan_.indices(BatchPosition{next_key_.epoch, next_key_.index}, key.rank,
                                 key.workers, next_key_.micro, key.micros);
    next_ = std::async(std::launch::async, [this, indices = std::move(indices)] {
      at::init_num_threads();  // the worker's intra-op thread count, not the machine's
      return load(indices);
    });
  }

  BatchPlan plan_;
  Dataset dataset_;
  pid_t parent_;  // the process that built it: it never prefetches
  Key next_key_{};
  std::future<Batch> next_;
};

template <typename Dataset>
std::size_t ShardedBatches<Dataset>::knownSize(const Dataset& dataset) {
  const auto size = dataset.size();
  if (!size.has_value()) throwUnknownSize();
  return *size;
}

}  // namespace gradagg::data
