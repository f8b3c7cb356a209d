// A worker's life: set up the replica once, then serve steps until told to stop.
//
// Set-up: check the header, make the snapshot read-only in this process, give
// the replica private buffers, point every parameter's .grad at this worker's
// slot and hook each parameter to flag that it received a gradient, then arrive.
//
// A step: wait for command_seq to change; load the snapshot (the parameters are
// already the parent's, in place; copy the buffers; zero the slot); run the
// user's shard function; backward (autograd accumulates straight into the slot);
// check what landed there; write loss, samples and buffers; arrive. Any exception
// becomes status kFailed with its message: the worker lives on for the next step.
#include "worker.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/nn/module.h>

#include "check.h"
#include "sync.h"

namespace gradagg::detail {

namespace {

constexpr auto kSpin = std::chrono::microseconds(50);
constexpr auto kParentCheck = std::chrono::milliseconds(100);

class Worker {
 public:
  explicit Worker(const WorkerSetup& s)
      : s_(s),
        base_(s.segment->base()),
        header_(*reinterpret_cast<Header*>(base_)),
        layout_(header_.layout),
        control_(*reinterpret_cast<WorkerControl*>(base_ + layout_.control_offset +
                                                  sizeof(WorkerControl) * s.rank)),
        slot_(base_ + layout_.slotOffset(s.rank)),
        flags_(reinterpret_cast<std::uint8_t*>(slot_ + layout_.slot_flags_offset)) {}

  int run() {
    std::uint32_t seen = 0;  // command_seq at fork time
    try {
      setUp();
      control_.status = static_cast<std::uint32_t>(SlotStatus::kOk);
    } catch (...) {
      fail();
    }
    arrive(0);
    if (control_.status != static_cast<std::uint32_t>(SlotStatus::kOk)) {
      awaitCommand(seen);  // the parent reads the message, then stops us
      return 3;
    }
    for (;;) {
      seen = awaitCommand(seen);
      if (seen == kParentGone) return 4;
      if (static_cast<Command>(header_.command) == Command::kStop) {
        setPhase(Phase::kStopping);
        return 0;
      }
      serveStep();
      arrive(seen);
    }
  }

 private:
  static constexpr std::uint32_t kParentGone = 0xffff'ffffu;

  void setPhase(Phase p) { control_.phase.store(static_cast<std::uint32_t>(p), std::memory_order_relaxed); }

  void setUp() {
    const std::string bad = validateHeader(base_, s_.segment->size());
    if (!bad.empty()) throw InternalError("gradagg: worker found a bad segment header: " + bad);
    control_.pid = static_cast<std::int32_t>(::getpid());
    at::set_num_threads(s_.threads);
    // The parameters are the parent's master values: read them, never write them.
    s_.segment->protectReadOnly(layout_.snapshot_offset,
                                layout_.sizes.param_bytes + layout_.sizes.buffer_bytes);
    at::NoGradGuard no_grad;
    for (TensorEntry& b : s_.binding->buffers()) b.tensor.set_data(viewAt(b, s_.binding->bufferRegion()).clone());
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
  }

  // Returns the new command_seq, or kParentGone.
  std::uint32_t awaitCommand(std::uint32_t seen) {
    setPhase(Phase::kWaiting);
    std::uint32_t v = spinWhileEqual(header_.command_seq, seen, kSpin);
    while (v == seen) {
      futexWait(header_.command_seq, seen, kParentCheck);
      v = header_.command_seq.load(std::memory_order_acquire);
      if (v == seen && ::getppid() != s_.parent) return kParentGone;
    }
    return v;
  }

  void serveStep() {
    control_.status = static_cast<std::uint32_t>(SlotStatus::kOk);
    control_.message[0] = '\0';
    try {
      loadSnapshot();
      setPhase(Phase::kShard);
      ShardContext ctx{s_.rank, static_cast<int>(layout_.sizes.workers), header_.step};
      auto t0 = Clock::now();
      ShardResult result = (*s_.shard)(ctx);
      control_.shard_ms = millisSince(t0);
      checkResult(result);
      setPhase(Phase::kBackward);
      t0 = Clock::now();
      result.loss.backward();
      control_.backward_ms = millisSince(t0);
      setPhase(Phase::kWritingSlot);
      writeSlot(result);
    } catch (...) {
      fail();
    }
  }

  void loadSnapshot() {
    setPhase(Phase::kLoadingSnapshot);
    const bool training = header_.training != 0;
    if (s_.model->is_training() != training) s_.model->train(training);
    at::NoGradGuard no_grad;
    for (TensorEntry& b : s_.binding->buffers())
      b.tensor.copy_(viewAt(b, s_.binding->bufferRegion()));
    std::memset(slot_, 0, layout_.sizes.param_bytes);
    std::memset(flags_, 0, layout_.sizes.param_count);
    auto& params = s_.binding->params();
    for (std::size_t k = 0; k < params.size(); ++k) {
      TensorEntry& p = params[k];
      if (p.requires_grad && !p.tensor.grad().is_same(grad_views_[k]))
        p.tensor.mutable_grad() = grad_views_[k];
    }
  }

  static void checkResult(const ShardResult& r) {
    if (!r.loss.defined()) throw InvalidArgument("the shard function returned no loss (undefined tensor)");
    if (r.loss.numel() != 1)
      throw InvalidArgument(fmt::format("the loss must be a scalar, got {}", describeTensor(r.loss)));
    if (!r.loss.requires_grad())
      throw InvalidArgument(
          "the loss does not require grad (computed under NoGradGuard, detached, or from "
          "parameters that do not require grad?)");
    if (r.samples <= 0)
      throw InvalidArgument(fmt::format("ShardResult.samples must be > 0, got {}", r.samples));
  }

  void writeSlot(const ShardResult& r) {
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
    std::byte* slot_buffers = slot_ + layout_.slot_buffers_offset;
    for (TensorEntry& b : s_.binding->buffers()) viewAt(b, slot_buffers).copy_(b.tensor);
    control_.samples = r.samples;
    control_.loss = r.loss.item<double>();
  }

  void fail() noexcept {
    control_.status = static_cast<std::uint32_t>(SlotStatus::kFailed);
    control_.failed_phase = control_.phase.load(std::memory_order_relaxed);
    std::string what;
    try {
      throw;
    } catch (const c10::Error& e) {
      what = e.what_without_backtrace();
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
      what = "unknown exception (not derived from std::exception)";
    }
    const std::size_t n = std::min(what.size(), kMessageBytes - 1);
    std::memcpy(control_.message, what.data(), n);
    control_.message[n] = '\0';
  }

  void arrive(std::uint32_t seq) {
    control_.done_seq.store(seq, std::memory_order_release);
    if (header_.remaining.fetch_sub(1, std::memory_order_acq_rel) == 1)
      futexWakeAll(header_.remaining);
  }

  const WorkerSetup& s_;
  std::byte* base_;
  Header& header_;
  const Layout layout_;
  WorkerControl& control_;
  std::byte* slot_;
  std::uint8_t* flags_;
  std::vector<at::Tensor> grad_views_;
};

}  // namespace

int workerMain(const WorkerSetup& setup) noexcept {
  int code = 126;
  try {
    std::thread t([&] {
      try {
        Worker w(setup);
        code = w.run();
      } catch (...) {
        code = 126;
      }
    });
    t.join();
  } catch (...) {
    code = 127;
  }
  return code;
}

}  // namespace gradagg::detail
