// The parent: construction, the workers' start, shutdown and the public
// calls; the step itself is step.cpp's (aggregator_impl.h holds the state).
//
// Construction: list the model's tensors, plan the layout, map the segment,
// move parameters and buffers into its snapshot, fork the workers, wait until
// every one has arrived once (its replica set up).
#include <gradagg/aggregator.h>

#include <unistd.h>

#include <cstdio>
#include <optional>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <gradagg/errors.h>

#include "aggregator/aggregator_impl.h"
#include "aggregator/worker.h"
#include "model/model_binding.h"
#include "runtime/blas_warning.h"
#include "runtime/control.h"
#include "runtime/process.h"
#include "runtime/segment.h"
#include "runtime/timeouts.h"
#include "step/layout.h"
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

Aggregator::Impl::Impl(ModelView m, ShardFn fn, Options opts)
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
  row_map = rowMap(binding.params());
  if (model.current_parameters)
    for (const auto& p : model.current_parameters()) param_list.push_back(p.unsafeGetTensorImpl());
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

WeightRule Aggregator::Impl::weightRule() const {
  WeightRule rule;
  rule.equal = options.weighting == Weighting::kEqual;
  rule.micro_steps = options.accumulation_steps;
  rule.divided_later = topology.stage->dividesLater();
  return rule;
}

void Aggregator::Impl::startWorkers() {
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

void Aggregator::Impl::shutdown() noexcept {
  channel.shutdown([this] { command(Command::kStop); }, options.shutdown_timeout);
  parent_share = ParentShare();
}

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
