// A worker's life: set up the replica once, then serve steps until told to stop.
//
// Set-up: check the header, make the snapshot read-only in this process, give
// the replica private buffers, point every parameter's .grad at this worker's
// slot and hook each parameter to flag that it received a gradient, then arrive
// on `reduced`.
//
// A step:
//   wait for command_seq to change;
//   load the snapshot: the parameters already are the parent's, in place; copy
//     the buffers; zero the slot;
//   run the user's shard function, then backward: autograd accumulates straight
//     into the slot; check what landed there (shape, finiteness); write loss,
//     samples and buffers. Any exception becomes a failed status with its
//     message: the worker lives on for the next step;
//   with early buckets (across nodes, core/buckets.h): during the last
//     backward, take one from bucket line b as soon as every gradient of
//     bucket b (and of the buckets before it) is in the slot; take the lines
//     still untaken before arriving on `computed`, whatever happened;
//   arrive on `computed`; the last to arrive (the closer) computes the step's
//     weights and whether every status is ok, once, for everyone; wait until
//     every worker has arrived and the closer is done;
//   if every status is ok, reduce this worker's range of the flat gradient over
//     all slots into this step's result (with early buckets, a range of the
//     last bucket: the parent summed the others); arrive on `reduced` (the parent waits).
#include "aggregator/worker.h"

#include <unistd.h>

#include <cmath>
#include <cstring>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include "core/check.h"
#include "core/control.h"
#include "core/sync.h"
#include "core/test_seam.h"

namespace gradagg::detail {

namespace {

// Runs after autograd accumulated a parameter's gradient (a post hook on its
// AccumulateGrad node, as c10d's Reducer does).
class AfterAccumulate final : public torch::autograd::FunctionPostHook {
 public:
  explicit AfterAccumulate(std::function<void()> f) : f_(std::move(f)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    f_();
    return outputs;
  }

 private:
  std::function<void()> f_;
};

class Worker {
 public:
  explicit Worker(const WorkerSetup& s)
      : s_(s),
        map_{s.segment->base(), s.layout},
        header_(map_.header()),
        n_(static_cast<int>(s.layout.sizes.workers)),
        control_(map_.control(s.rank)),
        channel_(header_.command_seq, WorkerWords{&control_.phase, &control_.done_seq}, s.parent),
        slot_(map_.slot(s.rank)),
        flags_(map_.slotFlags(s.rank)) {}

  int run() {
    std::uint32_t seen = s_.start_seq;
    try {
      setUp();
      control_.status = static_cast<std::uint32_t>(SlotStatus::kOk);
    } catch (...) {
      fail(SlotStatus::kFailed);
    }
    const bool ready = control_.status == static_cast<std::uint32_t>(SlotStatus::kOk);
    channel_.finish(header_.reduced, seen);
    if (!ready) {
      channel_.awaitCommand(seen);  // the parent reads the message, then stops us
      return 3;
    }
    for (;;) {
      const auto next = channel_.awaitCommand(seen);
      if (!next) return 4;  // the parent is gone
      seen = *next;
      if (static_cast<Command>(header_.command) == Command::kStop) {
        channel_.setPhase(Phase::kStopping);
        return 0;
      }
      control_.wake_ms = static_cast<double>(nowNs() - header_.command_ns) / 1e6;
      serveStep();
      auto t0 = Clock::now();
      if (!channel_.awaitZero(header_.computed)) return 4;
      control_.barrier_ms = millisSince(t0);
      t0 = Clock::now();
      reduce();
      control_.reduce_ms = millisSince(t0);
      channel_.finish(header_.reduced, seen);  // from here on it waits for the next step
    }
  }

 private:
  // Sets the phase and calls the test hook, if any.
  void enter(Phase p) {
    channel_.setPhase(p);
    if (const auto& hook = testHooks().on_worker_phase) hook(s_.rank, p, header_.step);
  }

  void setUp() {
    const std::string bad = validateHeader(map_.base, s_.segment->size(), &s_.layout);
    if (!bad.empty()) throw InternalError("gradagg: worker found a bad segment header: " + bad);
    control_.pid = static_cast<std::int32_t>(::getpid());
    at::set_num_threads(s_.threads);
    // The parameters are the parent's master values: read them, never write them.
    s_.segment->protectReadOnly(map_.snapshotParams(), map_.snapshotBytes());
    at::NoGradGuard no_grad;
    for (TensorEntry& b : s_.binding->buffers())
      b.tensor.set_data(viewAt(b, s_.binding->bufferRegion()).clone());
    auto& params = s_.binding->params();
    grad_views_.reserve(params.size());
    for (std::size_t k = 0; k < params.size(); ++k) {
      TensorEntry& p = params[k];
      grad_views_.push_back(viewAt(p, slot_));
      if (!p.requires_grad) continue;
      p.tensor.mutable_grad() = grad_views_[k];
      std::uint8_t* flag = flags_ + k;
      p.tensor.register_hook([flag](const at::Tensor&) { *flag = 1; });
    }
    for (int r = 0; r < n_; ++r) slots_.push_back(map_.slot(r));
    samples_.resize(n_);
    weights_.resize(n_);
    hookEarlyBuckets();
  }

  // With early buckets: count each early bucket's parameters, and hook each of
  // them to take its bucket's line once they all have their gradient.
  void hookEarlyBuckets() {
    early_ = s_.buckets != nullptr ? s_.buckets->early() : 0;
    if (early_ == 0) return;
    pending_of_.assign(static_cast<std::size_t>(early_), 0);
    auto& params = s_.binding->params();
    for (std::size_t k = 0; k < params.size(); ++k) {
      const int b = s_.buckets->of_param[k];
      if (b < 0 || b >= early_ || !params[k].requires_grad) continue;
      ++pending_of_[static_cast<std::size_t>(b)];
      auto accumulator = torch::autograd::impl::grad_accumulator(params[k].tensor);
      accumulator->add_post_hook(std::make_unique<AfterAccumulate>([this, k, b] {
        accumulated(k, b);
      }));
      accumulators_.push_back(std::move(accumulator));  // the variable holds it weakly
    }
  }

  // Parameter k's gradient of the last backward is in the slot (unless the
  // shard function moved .grad elsewhere: then no bucket goes early this step,
  // writeSlot copies, and the lines are taken at the end).
  void accumulated(std::size_t k, int b) {
    if (!armed_) return;
    if (!s_.binding->params()[k].tensor.grad().is_same(grad_views_[k])) {
      armed_ = false;
      return;
    }
    --pending_[static_cast<std::size_t>(b)];
    while (next_bucket_ < early_ && pending_[static_cast<std::size_t>(next_bucket_)] == 0)
      channel_.arrive(header_.bucket_lines[next_bucket_++]);
  }

  // Whatever early bucket lines this worker has not taken this step.
  void takeRemainingBucketLines() {
    armed_ = false;
    while (next_bucket_ < early_) channel_.arrive(header_.bucket_lines[next_bucket_++]);
  }

  void serveStep() {
    next_bucket_ = 0;  // no bucket line taken yet (takeRemainingBucketLines counts on it)
    control_.status = static_cast<std::uint32_t>(SlotStatus::kOk);
    control_.message[0] = '\0';
    control_.bad_param = -1;
    control_.load_ms = control_.shard_ms = control_.backward_ms = control_.write_ms = 0;
    try {
      auto t0 = Clock::now();
      loadSnapshot();
      control_.load_ms = millisSince(t0);
      ShardContext ctx;
      ctx.rank = s_.rank;
      ctx.workers = n_;
      ctx.step = header_.step;
      ctx.global_rank = s_.placement.worker_offset + s_.rank;
      ctx.global_workers = s_.placement.global_workers;
      ctx.node = s_.placement.node;
      ctx.nodes = s_.placement.nodes;
      ctx.micro_steps = s_.options->accumulation_steps;
      Accumulated sum;
      for (ctx.micro_step = 0; ctx.micro_step < ctx.micro_steps; ++ctx.micro_step)
        sum.add(microStep(ctx, sum.samples));
      enter(Phase::kWritingSlot);
      t0 = Clock::now();
      writeSlot(sum.samples, sum.loss(equalWeights()));
      control_.write_ms = millisSince(t0);
    } catch (...) {
      fail(SlotStatus::kFailed);
    }
    takeRemainingBucketLines();
    // Past this point the slot is complete: the reduction phase begins.
    try {
      enter(Phase::kReducing);
    } catch (...) {}
    if (channel_.arrive(header_.computed) == 1) close();  // the N-th of N + 1: the closer
  }

  // What the micro-batches of one step add up to.
  struct Accumulated {
    std::int64_t samples = 0;
    double weighted_loss = 0;  // sum of samples_i * loss_i
    double plain_loss = 0;     // sum of loss_i
    int count = 0;
    void add(const std::pair<double, std::int64_t>& micro) {
      samples += micro.second;
      weighted_loss += micro.first * static_cast<double>(micro.second);
      plain_loss += micro.first;
      ++count;
    }
    double loss(bool equal) const {
      if (count == 1) return plain_loss;
      return equal ? plain_loss / count : weighted_loss / static_cast<double>(samples);
    }
  };

  bool equalWeights() const { return s_.options->weighting == Weighting::kEqual; }

  // One micro-batch: the shard function, then backward into the slot. Returns
  // its loss and samples. Accumulating with kBySamples, backward starts from
  // `samples` instead of 1, so the slot holds the sum of samples_i * gradient_i
  // (the closer divides by the worker's total); one micro-batch, or kEqual, as is.
  // With early buckets, the last backward takes the bucket lines as it goes:
  // the samples are written before it.
  std::pair<double, std::int64_t> microStep(const ShardContext& ctx, std::int64_t samples_before) {
    enter(Phase::kShard);
    auto t0 = Clock::now();
    ShardResult result = (*s_.shard)(ctx);
    control_.shard_ms += millisSince(t0);
    checkResult(result);
    enter(Phase::kBackward);
    if (early_ > 0 && ctx.micro_step + 1 == ctx.micro_steps) {
      control_.samples = samples_before + result.samples;
      pending_ = pending_of_;
      armed_ = true;
    }
    t0 = Clock::now();
    if (ctx.micro_steps > 1 && !equalWeights())
      result.loss.backward(at::full_like(result.loss, static_cast<double>(result.samples)));
    else
      result.loss.backward();
    armed_ = false;
    control_.backward_ms += millisSince(t0);
    return {result.loss.item<double>(), result.samples};
  }

  void loadSnapshot() {
    enter(Phase::kLoadingSnapshot);
    if (s_.options->seed_workers) at::manual_seed(stepSeed());
    const bool training = header_.training != 0;
    const ModelView& m = *s_.model;
    if (m.set_training && (!m.is_training || m.is_training() != training)) m.set_training(training);
    at::NoGradGuard no_grad;
    for (TensorEntry& b : s_.binding->buffers())
      b.tensor.copy_(viewAt(b, s_.binding->bufferRegion()));
    std::memset(slot_, 0, s_.layout.sizes.param_bytes);
    std::memset(flags_, 0, s_.layout.sizes.param_count);
    auto& params = s_.binding->params();
    for (std::size_t k = 0; k < params.size(); ++k) {
      TensorEntry& p = params[k];
      if (p.requires_grad && !p.tensor.grad().is_same(grad_views_[k]))
        p.tensor.mutable_grad() = grad_views_[k];
    }
  }

  // splitmix64 of (seed, global rank, step): well spread, the same on a redo.
  std::uint64_t stepSeed() const {
    std::uint64_t z = s_.options->seed ^
                      (static_cast<std::uint64_t>(s_.placement.worker_offset + s_.rank) << 40) ^
                      static_cast<std::uint64_t>(header_.step);
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  static void checkResult(const ShardResult& r) {
    if (!r.loss.defined())
      throw InvalidArgument("the shard function returned no loss (undefined tensor)");
    if (r.loss.numel() != 1)
      throw InvalidArgument(
          fmt::format("the loss must be a scalar, got {}", describeTensor(r.loss)));
    if (!r.loss.requires_grad())
      throw InvalidArgument(
          "the loss does not require grad (computed under NoGradGuard, detached, or from "
          "parameters that do not require grad?)");
    if (r.samples <= 0)
      throw InvalidArgument(fmt::format("ShardResult.samples must be > 0, got {}", r.samples));
  }

  void writeSlot(std::int64_t samples, double loss) {
    auto& params = s_.binding->params();
    at::NoGradGuard no_grad;
    for (std::size_t k = 0; k < params.size(); ++k) {
      TensorEntry& p = params[k];
      const at::Tensor& t = p.tensor;
      if (t.data_ptr() != s_.binding->paramRegion() + p.offset || !t.sizes().equals(p.sizes) ||
          t.scalar_type() != p.dtype) {
        const std::string now = describeTensor(t);
        t.set_data(viewAt(p, s_.binding->paramRegion()));  // undo it for the next step
        throw InvalidArgument(fmt::format(
            "parameter '{}' was replaced in the worker's replica (now {} in other memory, the "
            "snapshot holds {}); the shard function must not replace parameters",
            p.name, now, describeShape(p.sizes, p.dtype)));
      }
      if (!p.requires_grad) continue;
      const at::Tensor& g = t.grad();
      if (!g.defined() || g.is_same(grad_views_[k])) continue;
      // The shard function reset or replaced .grad: copy what autograd left.
      if (!g.sizes().equals(p.sizes) || g.scalar_type() != p.dtype || !g.is_cpu())
        throw InvalidArgument(fmt::format("parameter '{}': gradient is {}, expected {}", p.name,
                                          describeTensor(g), describeShape(p.sizes, p.dtype)));
      grad_views_[k].copy_(g.is_sparse() ? g.to_dense() : g);
      flags_[k] = 1;
      p.tensor.mutable_grad() = grad_views_[k];
    }
    std::byte* slot_buffers = map_.slotBuffers(s_.rank);
    for (TensorEntry& b : s_.binding->buffers()) viewAt(b, slot_buffers).copy_(b.tensor);
    control_.samples = samples;
    control_.loss = loss;
    checkFinite();
  }

  void checkFinite() {
    const auto& flat = *s_.flat;
    for (std::size_t k = 0; k < flat.size(); ++k) {
      if (flags_[k] == 0 || allFinite(flat[k].type, slot_ + flat[k].offset, flat[k].count))
        continue;
      control_.bad_param = static_cast<std::int32_t>(k);
      throw NonFiniteGradient(fmt::format("parameter '{}' has a non-finite gradient (loss {})",
                                          s_.binding->params()[k].name, control_.loss),
                              s_.rank, Phase::kWritingSlot, "", s_.binding->params()[k].name);
    }
    if (!std::isfinite(control_.loss))
      throw NonFiniteGradient(fmt::format("the loss is {}", control_.loss), s_.rank,
                              Phase::kWritingSlot, "", "");
  }

  // The closer: the worker that took the N-th from `computed` (the parent set
  // it to N + 1) sees every slot and status. It writes the step's summary and
  // the weights once, for the other workers and the parent, then takes the last
  // one and wakes them.
  void close() {
    bool ok = true;
    for (int r = 0; r < n_; ++r) {
      const WorkerControl& c = map_.control(r);
      ok = ok && c.status == static_cast<std::uint32_t>(SlotStatus::kOk);
      samples_[r] = c.samples;
    }
    const bool equal = equalWeights();
    double total = 0;
    for (int r = 0; r < n_; ++r) total += equal ? 1.0 : static_cast<double>(samples_[r]);
    if (ok) computeWeights(equal, samples_.data(), n_, weights_.data(), s_.placement.normalize);
    for (int r = 0; r < n_; ++r) map_.control(r).weight = ok ? weights_[r] : 0.0;
    header_.weight_total = ok ? total : 0.0;
    header_.step_ok = ok ? 1 : 0;
    channel_.arrive(header_.computed);
  }

  // After `computed` read 0: the summary is final.
  void reduce() {
    if (header_.step_ok == 0) return;  // nothing is applied
    // The step's weights are per mean gradient (the loss and the buffers use
    // them so); accumulated slots hold sums (see microStep): divide by the
    // worker's samples, or with kEqual its micro-batches.
    const int k = s_.options->accumulation_steps;
    for (int r = 0; r < n_; ++r) {
      const WorkerControl& c = map_.control(r);
      weights_[r] = slotWeight(c.weight, equalWeights(), k, c.samples);
    }
    reduceRange(*s_.flat, s_.range, map_.result(header_.result_index), slots_.data(),
                weights_.data(), n_);
  }

  void fail(SlotStatus status) noexcept {
    control_.failed_phase = control_.phase.load(std::memory_order_relaxed);
    std::string what;
    try {
      throw;
    } catch (const NonFiniteGradient& e) {
      status = SlotStatus::kNonFinite;
      what = e.what();
    } catch (const c10::Error& e) {
      what = e.what_without_backtrace();
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
      what = "unknown exception (not derived from std::exception)";
    }
    control_.status = static_cast<std::uint32_t>(status);
    const std::size_t n = std::min(what.size(), kMessageBytes - 1);
    std::memcpy(control_.message, what.data(), n);
    control_.message[n] = '\0';
  }

  const WorkerSetup& s_;
  const SegmentMap map_;
  Header& header_;
  const int n_;
  WorkerControl& control_;
  WorkerChannel channel_;
  std::byte* slot_;
  std::uint8_t* flags_;
  std::vector<at::Tensor> grad_views_;
  std::vector<const std::byte*> slots_;  // every slot's gradient area
  std::vector<std::int64_t> samples_;
  std::vector<double> weights_;
  // Early buckets (core/buckets.h): how many, each one's hooked parameters, how
  // many of them still lack this step's gradient, the next line to take, and
  // whether the hooks count (during the last backward only).
  int early_ = 0;
  std::vector<int> pending_of_;
  std::vector<int> pending_;
  int next_bucket_ = 0;
  bool armed_ = false;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
};

}  // namespace

int workerMain(const WorkerSetup& setup) {
  Worker worker(setup);
  return worker.run();
}

}  // namespace gradagg::detail
