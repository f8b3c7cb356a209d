#include "step/readiness.h"

#include <functional>
#include <stdexcept>

#include <fmt/format.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace gradagg::detail {

namespace {
// Runs after autograd accumulated a parameter's gradient (a post hook on its
// AccumulateGrad function, as c10d's Reducer does).
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
}  // namespace

BucketReadiness::BucketReadiness(ModelBinding& binding, const SlotWriter& slot,
                                 const BucketPlan& plan, std::atomic<std::uint32_t>* lines,
                                 WorkerChannel& channel)
    : binding_(binding), slot_(slot), lines_(lines), channel_(channel), early_(plan.early()) {
  if (early_ == 0) return;
  pending_of_.assign(static_cast<std::size_t>(early_), 0);
  auto& params = binding.params();
  for (std::size_t k = 0; k < params.size(); ++k) {
    const int b = plan.of_param[k];
    if (b < 0 || b >= early_ || !params[k].requires_grad) continue;
    ++pending_of_[static_cast<std::size_t>(b)];
    auto accumulator = torch::autograd::impl::grad_accumulator(params[k].tensor);
    accumulator->add_post_hook(
        std::make_unique<AfterAccumulate>([this, k, b] { accumulated(k, b); }));
    accumulators_.push_back(std::move(accumulator));
  }
}

void BucketReadiness::arm() {
  if (early_ == 0) return;
  pending_ = pending_of_;
  counted_.assign(binding_.params().size(), 0);
  armed_ = true;
}

void BucketReadiness::accumulated(std::size_t k, int bucket) {
  if (!armed_) return;
  if (!binding_.params()[k].tensor.grad().is_same(slot_.gradView(k))) {
    armed_ = false;
    return;
  }
  // Accumulated again in the same backward: a reentrant backward over this
  // parameter (torch.utils.checkpoint with use_reentrant=True recomputes its
  // segment and runs a backward of its own inside this one) as well as the
  // model's own use. Its first accumulation was not its last: while its bucket
  // is still here that is harmless (counted once, it leaves after this one);
  // once the bucket has gone, the other nodes got part of its gradient, and
  // the step fails rather than apply a wrong sum (DDP's Reducer refuses the
  // same: "mark a variable ready only once").
  if (counted_[k]) {
    if (bucket < next_)
      throw std::runtime_error(fmt::format(
          "gradagg: parameter '{}' got its gradient twice in one backward (a reentrant "
          "backward over it, e.g. torch.utils.checkpoint with use_reentrant=True on a segment "
          "that uses it, besides the model's own use), after its bucket had gone to the other "
          "nodes with the first part; set NodeOptions::overlap = false (GRADAGG_OVERLAP=0) so "
          "the buckets leave after backward, or use a non-reentrant checkpoint",
          binding_.params()[k].name));
    return;
  }
  counted_[k] = 1;
  --pending_[static_cast<std::size_t>(bucket)];
  while (next_ < early_ && pending_[static_cast<std::size_t>(next_)] == 0)
    channel_.arrive(lines_[next_++]);
}

void BucketReadiness::takeRemaining() {
  armed_ = false;
  while (next_ < early_) channel_.arrive(lines_[next_++]);
}

}  // namespace gradagg::detail
