// A worker's life: set up the replica once, then serve steps until told to
// stop (the serve loop, runtime/serve.h).
//
// Set-up: check the header, make the snapshot and the message read-only in
// this process (a write into the snapshot is reported before the SIGSEGV
// kills the worker: runtime/write_fault.h), give the replica private buffers, point every
// parameter's .grad at this worker's slot (SlotWriter::bind) and hook the early buckets' gradients
// (BucketReadiness), then arrive on `reduced`.
//
// A step:
//   load the snapshot: the parameters already are the parent's, in place; copy
//     the buffers; begin the slot (zeroed, status ok); read the message;
//   run the user's shard function, then backward: autograd accumulates straight
//     into the slot (a micro-batch with 0 samples runs no backward); write
//     loss, counts, metrics and buffers and check what landed
//     (SlotWriter::write). Any exception becomes a failed status with its
//     message: the worker lives on for the next step;
//   with early buckets, take each bucket's line during the last backward as
//     its gradients arrive, and the lines still untaken before arriving on
//     `computed`, whatever happened;
//   arrive on `computed`; the last to arrive is the closer (ReduceScatter::
//     close: the step's weights, once, for everyone); wait until it is done;
//   reduce this worker's range of the flat gradient over all slots into the
//     step's result; the serve loop then arrives on `reduced` (the parent waits).
#include "aggregator/worker.h"

#include <unistd.h>

#include <optional>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/variable.h>

#include <gradagg/blas.h>

#include "runtime/control.h"
#include "runtime/heap.h"
#include "runtime/mix.h"
#include "runtime/serve.h"
#include "runtime/sync.h"
#include "runtime/test_seam.h"
#include "runtime/write_fault.h"
#include "step/message.h"
#include "step/readiness.h"
#include "step/reduce_scatter.h"
#include "step/slots.h"

namespace gradagg::detail {

namespace {

// What the micro-batches of one step add up to (those with samples only).
struct Accumulated {
  std::int64_t samples = 0;
  double weighted_loss = 0;  // sum of samples_i * loss_i
  double plain_loss = 0;     // sum of loss_i
  int count = 0;             // micro-batches with samples
  std::map<std::string, double> metrics;
  void add(double loss, const ShardResult& micro) {
    for (const auto& [name, value] : micro.metrics) metrics[name] += value;
    if (micro.samples == 0) return;
    samples += micro.samples;
    weighted_loss += loss * static_cast<double>(micro.samples);
    plain_loss += loss;
    ++count;
  }
  double loss(bool equal) const {
    if (count <= 1) return plain_loss;
    return equal ? plain_loss / count : weighted_loss / static_cast<double>(samples);
  }
};

void checkResult(const ShardResult& r) {
  if (r.samples < 0)
    throw InvalidArgument(fmt::format("ShardResult.samples must be >= 0, got {}", r.samples));
  if (r.samples == 0) return;  // nothing to do this step: the loss is not used
  if (!r.loss.defined())
    throw InvalidArgument(
        "the shard function returned no loss (undefined tensor) with samples > 0 (a worker "
        "with nothing to do returns samples = 0)");
  if (r.loss.numel() != 1)
    throw InvalidArgument(fmt::format("the loss must be a scalar, got {}", describeTensor(r.loss)));
  if (!r.loss.requires_grad())
    throw InvalidArgument(
        "the loss does not require grad (computed under NoGradGuard, detached, or from "
        "parameters that do not require grad?)");
}

class Worker final : public ServedWorker {
 public:
  explicit Worker(const WorkerSetup& s)
      : s_(s),
        map_{s.segment->base(), s.layout},
        header_(map_.header()),
        channel_(header_.command_seq,
                 WorkerWords{&map_.control(s.rank).phase, &map_.control(s.rank).done_seq},
                 s.parent),
        slot_(map_, s.rank),
        sum_(map_, flatParams(*s.binding), s.weights) {}

  int run() { return serveCommands(*this, channel_, header_.reduced, s_.start_seq); }

  void setUp() override {
    const std::string bad = validateHeader(map_.base, s_.segment->size(), &s_.layout);
    if (!bad.empty()) throw InternalError("gradagg: worker found a bad segment header: " + bad);
    slot_.setPid(static_cast<std::int32_t>(::getpid()));
    if (s_.options->keep_worker_memory) keepFreedMemory();
    at::set_num_threads(s_.threads);
    setBlasThreads(s_.threads);  // a BLAS with a pool of its own (gradagg/blas.h)
    // The parameters are the parent's master values: read them, never write them.
    s_.segment->protectReadOnly(map_.snapshotParams(), map_.snapshotBytes());
    s_.segment->protectReadOnly(map_.message(), map_.layout.sizes.message_bytes);
    reportWriteFaults(map_.snapshotParams(), map_.snapshotBytes(),
                      &map_.control(s_.rank).fault_offset);
    at::NoGradGuard no_grad;
    for (TensorEntry& b : s_.binding->buffers())
      b.tensor.set_data(viewAt(b, s_.binding->bufferRegion()).clone());
    slot_.bind(*s_.binding);
    readiness_.emplace(*s_.binding, slot_, *s_.buckets, header_.bucket_lines, channel_);
  }

  void failed() noexcept override { slot_.failed(); }

  bool stopCommanded() const override {
    return static_cast<Command>(header_.command) == Command::kStop;
  }

  bool serve() override {
    PhaseTimes& times = slot_.times();
    times.wake_ms = static_cast<double>(nowNs() - header_.command_ns) / 1e6;
    compute();
    auto t0 = Clock::now();
    if (!channel_.awaitZero(header_.computed)) return false;
    times.barrier_ms = millisSince(t0);
    t0 = Clock::now();
    sum_.reduce(s_.range);
    times.reduce_ms = millisSince(t0);
    return true;
  }

 private:
  // Sets the phase and calls the test hook, if any.
  void enter(Phase p) {
    channel_.setPhase(p);
    if (const auto& hook = testHooks().on_worker_phase) hook(s_.rank, p, header_.step);
  }

  // The slot's part of the step, up to the arrival on `computed`.
  void compute() {
    readiness_->beginStep();
    slot_.begin();
    PhaseTimes& times = slot_.times();
    try {
      auto t0 = Clock::now();
      loadSnapshot();
      times.load_ms = millisSince(t0);
      ShardContext ctx;
      ctx.rank = s_.rank;
      ctx.workers = map_.workers();
      ctx.step = header_.step;
      if (header_.epoch >= 0) ctx.position = BatchPosition{header_.epoch, header_.batch_index};
      ctx.global_rank = s_.ranks.global_offset + s_.rank;
      ctx.global_workers = s_.ranks.global_workers;
      ctx.node = s_.ranks.node;
      ctx.nodes = s_.ranks.nodes;
      ctx.micro_steps = s_.options->accumulation_steps;
      readMessage(map_.message(), ctx.message);
      Accumulated sum;
      for (ctx.micro_step = 0; ctx.micro_step < ctx.micro_steps; ++ctx.micro_step)
        microStep(ctx, sum);
      enter(Phase::kWritingSlot);
      t0 = Clock::now();
      slot_.write(SlotSummary{SlotCounts{sum.samples, sum.count}, sum.loss(s_.weights.equal),
                              &sum.metrics});
      times.write_ms = millisSince(t0);
    } catch (...) {
      slot_.failed();
    }
    readiness_->takeRemaining();
    // Past this point the slot is complete: the reduction phase begins.
    try {
      enter(Phase::kReducing);
    } catch (...) {
    }
    if (channel_.arrive(header_.computed) == 1) {  // the N-th of N + 1: the closer
      sum_.close();
      channel_.arrive(header_.computed);
    }
  }

  // One micro-batch: the shard function, then backward into the slot; adds
  // its loss, samples and metrics to `sum`. Accumulating by samples, backward
  // starts from `samples` instead of 1, so the slot holds the sum of
  // samples_i * gradient_i (WeightRule's factor divides by the worker's
  // total); one micro-batch, or equal weighting, as is. With 0 samples no
  // backward runs. With early buckets, the last backward takes the bucket
  // lines as it goes: the counts are written before it.
  void microStep(const ShardContext& ctx, Accumulated& sum) {
    enter(Phase::kShard);
    PhaseTimes& times = slot_.times();
    const std::uint64_t seen = slot_.gradientsSeen();
    auto t0 = Clock::now();
    ShardResult result = (*s_.shard)(ctx);
    times.shard_ms += millisSince(t0);
    if (slot_.gradientsSeen() != seen && ctx.micro_step == 0 && slot_.anyGradientWritten())
      throw InvalidArgument(
          "the shard function ran backward() itself; gradagg runs backward on the loss the "
          "shard function returns: return the loss instead");
    checkResult(result);
    if (result.samples == 0) {
      sum.add(0, result);
      return;
    }
    enter(Phase::kBackward);
    if (readiness_->early() > 0 && ctx.micro_step + 1 == ctx.micro_steps) {
      slot_.setCounts(SlotCounts{sum.samples + result.samples, sum.count + 1});
      readiness_->arm();
    }
    t0 = Clock::now();
    if (ctx.micro_steps > 1 && !s_.weights.equal)
      result.loss.backward(at::full_like(result.loss, static_cast<double>(result.samples)));
    else
      result.loss.backward();
    readiness_->disarm();
    times.backward_ms += millisSince(t0);
    sum.add(result.loss.item<double>(), result);
  }

  void loadSnapshot() {
    enter(Phase::kLoadingSnapshot);
    if (s_.options->seed_workers)
      at::manual_seed(
          workerSeed(*s_.options->seed, s_.ranks.global_offset + s_.rank, header_.step));
    const bool training = header_.training != 0;
    const ModelView& m = *s_.model;
    if (m.set_training && (!m.is_training || m.is_training() != training)) m.set_training(training);
    at::NoGradGuard no_grad;
    for (TensorEntry& b : s_.binding->buffers())
      b.tensor.copy_(viewAt(b, s_.binding->bufferRegion()));
  }

  const WorkerSetup& s_;
  const SegmentMap map_;
  Header& header_;
  WorkerChannel channel_;
  SlotWriter slot_;
  ReduceScatter sum_;
  std::optional<BucketReadiness> readiness_;  // from setUp
};

}  // namespace

int workerMain(const WorkerSetup& setup) {
  Worker worker(setup);
  return worker.run();
}

}  // namespace gradagg::detail
