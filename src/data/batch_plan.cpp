// The index rule of gradagg/data.h: DistributedSampler's order, the global
// batch of a step, a worker's contiguous part of it, a micro-batch's of that.
#include <gradagg/data.h>

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <gradagg/errors.h>

namespace gradagg::data {

namespace {
// [begin, end) of part `index` of `count` contiguous parts of `size` items,
// sizes differing by at most one (the first `size % count` one larger).
std::pair<std::size_t, std::size_t> split(std::size_t size, int index, int count) {
  const auto n = static_cast<std::size_t>(count), i = static_cast<std::size_t>(index);
  const std::size_t base = size / n, rem = size % n;
  const std::size_t begin = i * base + std::min(i, rem);
  return {begin, begin + base + (i < rem ? 1 : 0)};
}

void checkPart(const char* what, int index, int count) {
  if (count < 1 || index < 0 || index >= count)
    throw InvalidArgument(fmt::format("gradagg::data: {} {} of {}: expected 0 <= {} < {} >= 1",
                                      what, index, count, index, count));
}
}  // namespace

void throwUnknownSize() {
  throw InvalidArgument(
      "gradagg::data::ShardedBatches: the dataset's size() is unknown (a stream or a stateful "
      "dataset); sharded batches need a map-style dataset of known size");
}

BatchPlan::BatchPlan(std::size_t dataset_size, std::size_t batch_size,
                     ShardedBatchesOptions options)
    : size_(dataset_size), batch_(batch_size), options_(options) {
  if (batch_size == 0)
    throw InvalidArgument("gradagg::data::ShardedBatches: batch_size 0, expected >= 1");
  if (dataset_size == 0)
    throw InvalidArgument("gradagg::data::ShardedBatches: the dataset is empty");
  if (options.drop_last && dataset_size < batch_size)
    throw InvalidArgument(fmt::format(
        "gradagg::data::ShardedBatches: drop_last with {} samples and batch_size {} leaves no "
        "batch at all",
        dataset_size, batch_size));
  steps_per_epoch_ = static_cast<std::int64_t>(
      options.drop_last ? dataset_size / batch_size : (dataset_size + batch_size - 1) / batch_size);
}

std::int64_t BatchPlan::epoch(std::int64_t step) const {
  if (step < 0) throw InvalidArgument(fmt::format("gradagg::data: step {}, expected >= 0", step));
  return step / steps_per_epoch_;
}

const std::vector<std::int64_t>& BatchPlan::order(std::int64_t epoch) const {
  if (cached_epoch_ == epoch) return order_;
  const auto n = static_cast<std::int64_t>(size_);
  at::Tensor perm;
  if (options_.shuffle) {
    // torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).
    at::Generator gen =
        at::detail::createCPUGenerator(options_.seed + static_cast<std::uint64_t>(epoch));
    perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
  } else {
    perm = at::arange(n, at::TensorOptions().dtype(at::kLong));
  }
  const std::int64_t* p = perm.data_ptr<std::int64_t>();
  order_.assign(p, p + n);
  cached_epoch_ = epoch;
  return order_;
}

BatchPosition BatchPlan::positionOf(std::int64_t step) const {
  const std::int64_t e = epoch(step);
  return {e, step - e * steps_per_epoch_};
}

std::vector<BatchPosition> BatchPlan::steps(std::int64_t epoch, BatchPosition start) const {
  if (epoch < 0)
    throw InvalidArgument(fmt::format("gradagg::data: epoch {}, expected >= 0", epoch));
  std::int64_t first = 0;
  if (start.epoch > epoch)
    first = steps_per_epoch_;
  else if (start.epoch == epoch)
    first = std::clamp<std::int64_t>(start.index, 0, steps_per_epoch_);
  std::vector<BatchPosition> out;
  out.reserve(static_cast<std::size_t>(steps_per_epoch_ - first));
  for (std::int64_t i = first; i < steps_per_epoch_; ++i) out.push_back({epoch, i});
  return out;
}

std::pair<std::size_t, std::size_t> BatchPlan::part(const BatchPosition& position, int global_rank,
                                                    int global_workers, int micro_step,
                                                    int micro_steps) const {
  checkPart("worker", global_rank, global_workers);
  checkPart("micro-batch", micro_step, micro_steps);
  if (position.epoch < 0 || position.index < 0 || position.index >= steps_per_epoch_)
    throw InvalidArgument(fmt::format(
        "gradagg::data: batch {} of epoch {}: expected epoch >= 0 and 0 <= batch < {} (the "
        "batches of an epoch of {} samples in batches of {}{})",
        position.index, position.epoch, steps_per_epoch_, size_, batch_,
        options_.drop_last ? ", the last one dropped" : ""));
  const std::size_t begin = static_cast<std::size_t>(position.index) * batch_;
  const std::size_t end = std::min(begin + batch_, size_);
  const auto [w0, w1] = split(end - begin, global_rank, global_workers);
  const auto [m0, m1] = split(w1 - w0, micro_step, micro_steps);
  return {begin + w0 + m0, begin + w0 + m1};
}

std::vector<std::size_t> BatchPlan::indices(const BatchPosition& position, int global_rank,
                                            int global_workers, int micro_step,
                                            int micro_steps) const {
  const auto [begin, end] = part(position, global_rank, global_workers, micro_step, micro_steps);
  const std::vector<std::int64_t>& all = order(position.epoch);
  return std::vector<std::size_t>(all.begin() + static_cast<std::ptrdiff_t>(begin),
                                  all.begin() + static_cast<std::ptrdiff_t>(end));
}

std::int64_t BatchPlan::samples(const ShardContext& ctx) const {
  const auto [begin, end] =
      part(positionOf(ctx), ctx.global_rank, ctx.global_workers, ctx.micro_step, ctx.micro_steps);
  return static_cast<std::int64_t>(end - begin);
}

}  // namespace gradagg::data
