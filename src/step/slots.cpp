#include "step/slots.h"

#include <cmath>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "runtime/utf8.h"

namespace gradagg::detail {

SlotWriter::SlotWriter(const SegmentMap& map, int rank)
    : map_(map),
      rank_(rank),
      control_(map.control(rank)),
      gradient_(map.slot(rank)),
      flags_(map.slotFlags(rank)),
      rows_(map.slotRows(rank)) {}

void SlotWriter::bind(ModelBinding& binding) {
  binding_ = &binding;
  flat_ = flatParams(binding);
  row_map_ = rowMap(binding.params());
  auto& params = binding.params();
  grad_views_.reserve(params.size());
  for (std::size_t k = 0; k < params.size(); ++k) {
    TensorEntry& p = params[k];
    grad_views_.push_back(viewAt(p, gradient_));
    if (!p.requires_grad) continue;
    p.tensor.mutable_grad() = grad_views_[k];
    std::uint8_t* flag = flags_ + k;
    std::uint64_t* seen = &gradients_seen_;
    std::uint8_t* rows = rows_ + row_map_.offset[k];
    const std::int64_t row_count = row_map_.rows[k];
    // Autograd adds a sparse gradient into the dense slot view (.grad) in
    // place; the hook sees it as it arrives and notes its rows.
    p.tensor.register_hook([flag, seen, rows, row_count](const at::Tensor& grad) {
      if (grad.is_sparse()) {
        *flag |= kSparseGrad;
        markRows(rows, row_count, grad);
      } else {
        *flag |= kDenseGrad;
      }
      ++*seen;
    });
  }
}

void SlotWriter::begin() {
  control_.status = static_cast<std::uint32_t>(SlotStatus::kOk);
  control_.message[0] = '\0';
  control_.bad_param = -1;
  control_.samples = 0;
  control_.micro_count = 0;
  control_.loss = 0;
  control_.metric_count = 0;
  const double wake_ms = control_.times.wake_ms;
  control_.times = PhaseTimes{};
  control_.times.wake_ms = wake_ms;
  std::memset(gradient_, 0, map_.layout.sizes.param_bytes);
  std::memset(flags_, 0, map_.layout.sizes.param_count);
  std::memset(rows_, 0, map_.layout.sizes.row_bytes);
  auto& params = binding_->params();
  for (std::size_t k = 0; k < params.size(); ++k) {
    TensorEntry& p = params[k];
    if (p.requires_grad && !p.tensor.grad().is_same(grad_views_[k]))
      p.tensor.mutable_grad() = grad_views_[k];
  }
}

bool SlotWriter::anyGradientWritten() const {
  for (std::size_t k = 0; k < grad_views_.size(); ++k)
    if (flags_[k] != 0 && grad_views_[k].count_nonzero().item<std::int64_t>() > 0) return true;
  return false;
}

void SlotWriter::write(const SlotSummary& summary) {
  auto& params = binding_->params();
  at::NoGradGuard no_grad;
  for (std::size_t k = 0; k < params.size(); ++k) {
    TensorEntry& p = params[k];
    const at::Tensor& t = p.tensor;
    if (t.data_ptr() != binding_->paramRegion() + p.offset || !t.sizes().equals(p.sizes) ||
        t.scalar_type() != p.dtype) {
      const std::string now = describeTensor(t);
      t.set_data(viewAt(p, binding_->paramRegion()));  // undo it for the next step
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
    flags_[k] |= g.is_sparse() ? kSparseGrad : kDenseGrad;
    p.tensor.mutable_grad() = grad_views_[k];
  }
  std::byte* slot_buffers = map_.slotBuffers(rank_);
  for (TensorEntry& b : binding_->buffers()) viewAt(b, slot_buffers).copy_(b.tensor);
  setCounts(summary.counts);
  control_.loss = summary.loss;
  writeMetrics(summary.metrics);
  checkFinite();
}

void SlotWriter::writeMetrics(const std::map<std::string, double>* metrics) {
  control_.metric_count = 0;
  if (metrics == nullptr || metrics->empty()) return;
  if (metrics->size() > static_cast<std::size_t>(ShardResult::kMaxMetrics))
    throw InvalidArgument(fmt::format("the shard function returned {} metrics, at most {} fit",
                                      metrics->size(), ShardResult::kMaxMetrics));
  std::uint32_t i = 0;
  for (const auto& [name, value] : *metrics) {
    if (name.empty() || name.size() > ShardResult::kMaxMetricNameBytes)
      throw InvalidArgument(fmt::format("metric '{}': a name of 1..{} bytes expected", name,
                                        ShardResult::kMaxMetricNameBytes));
    MetricEntry& e = control_.metrics[i++];
    std::memcpy(e.name, name.data(), name.size());
    e.name[name.size()] = '\0';
    e.value = value;
  }
  control_.metric_count = i;
}

void SlotWriter::checkFinite() {
  for (std::size_t k = 0; k < flat_.size(); ++k) {
    if (flags_[k] == 0 || allFinite(flat_[k].type, gradient_ + flat_[k].offset, flat_[k].count))
      continue;
    control_.bad_param = static_cast<std::int32_t>(k);
    const std::string& name = binding_->params()[k].name;
    throw NonFiniteGradient(
        fmt::format("parameter '{}' has a non-finite gradient (loss {})", name, control_.loss),
        rank_, Phase::kWritingSlot, "", name);
  }
  if (control_.samples > 0 && !std::isfinite(control_.loss))
    throw NonFiniteGradient(fmt::format("the loss is {}", control_.loss), rank_,
                            Phase::kWritingSlot, "", "");
}

void SlotWriter::failed() noexcept {
  control_.failed_phase = control_.phase.load(std::memory_order_relaxed);
  SlotStatus status = SlotStatus::kFailed;
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
  const std::size_t n = utf8PrefixBytes(what, kMessageBytes - 1);
  std::memcpy(control_.message, what.data(), n);
  control_.message[n] = '\0';
}

// ---- parent -----------------------------------------------------------------

SlotReader::SlotReader(const SegmentMap& map) : map_(map), workers_(map.workers()) {}

void SlotReader::prepareStart() {
  for (int r = 0; r < workers_; ++r) {
    WorkerControl& c = map_.control(r);
    c.status = static_cast<std::uint32_t>(SlotStatus::kOk);
    c.message[0] = '\0';
    c.fault_offset.store(-1, std::memory_order_relaxed);
  }
}

bool SlotReader::identicalGradients() const {
  const std::uint64_t bytes = map_.layout.sizes.param_bytes;
  int first = -1, compared = 0;
  for (int r = 0; r < workers_; ++r) {
    if (!ok(r) || samples(r) <= 0) continue;
    if (first < 0) {
      first = r;
      continue;
    }
    // Different gradients differ within their first bytes: this is cheap
    // unless they are the same, which is then said once.
    if (std::memcmp(map_.slot(first), map_.slot(r), bytes) != 0) return false;
    ++compared;
  }
  if (compared == 0) return false;
  const std::byte* g = map_.slot(first);
  for (std::uint64_t i = 0; i < bytes; ++i)
    if (g[i] != std::byte{0}) return true;  // all zeros (a frozen model) is not a sign
  return false;
}

Contribution SlotReader::collect(const RowMap& rows) {
  Contribution out;
  for (int r = workers_ - 1; r >= 0; --r) {
    if (status(r) == SlotStatus::kFailed) out.failed_rank = r;
    if (status(r) == SlotStatus::kNonFinite) out.non_finite_rank = r;
  }
  StepSums& t = out.sums;
  t.weight_total = map_.header().weight_total;
  const SlotWeight* weights = map_.weights();
  for (int r = 0; r < workers_; ++r) {
    const WorkerControl& c = map_.control(r);
    t.loss += weights[r].weight * c.loss;
    t.samples += c.samples;
  }
  const std::size_t params = rows.rows.size();
  has_grad_.resize(params);
  bool sparse = false;
  for (std::size_t k = 0; k < params; ++k) {
    std::uint8_t flags = 0;
    for (int r = 0; r < workers_; ++r) flags |= map_.slotFlags(r)[k];
    has_grad_[k] = flags;
    if (!sparseOnly(flags)) continue;
    if (!sparse) rows_.assign(rows.bytes, 0);  // the first step with any: allocates once
    sparse = true;
    std::uint8_t* touched = rows_.data() + rows.offset[k];
    for (int r = 0; r < workers_; ++r) {
      const std::uint8_t* in = map_.slotRows(r) + rows.offset[k];
      for (std::int64_t i = 0; i < rows.rows[k]; ++i) touched[i] |= in[i];
    }
  }
  out.has_grad = has_grad_;
  if (sparse) out.rows = rows_;
  return out;
}

std::string SlotReader::message(int r) const {
  const char* m = map_.control(r).message;
  return std::string(m, ::strnlen(m, kMessageBytes));
}

void SlotReader::report(int r, WorkerReport& out) const {
  const WorkerControl& c = map_.control(r);
  const PhaseTimes& t = c.times;
  out.loss = c.loss;
  out.samples = c.samples;
  out.wake_ms = t.wake_ms;
  out.load_ms = t.load_ms;
  out.shard_ms = t.shard_ms;
  out.backward_ms = t.backward_ms;
  out.write_ms = t.write_ms;
  out.barrier_ms = t.barrier_ms;
  out.reduce_ms = t.reduce_ms;
}

}  // namespace gradagg::detail
