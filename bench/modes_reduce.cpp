// The reduction itself. reduce-only: N slots of P elements summed by gradagg's
// kernel (reduceSlots, kernels.h), next to a plain c = a + b over as many bytes
// on the same threads and a Gloo allreduce of the same P floats among N
// processes. check: one step's mean gradient from shm and from gloo, from the
// same parameters and data, must agree (and, for information, single's).
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "modes.h"

namespace gradagg::bench {

namespace {

at::ScalarType reduceDtype(const std::string& name) {
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  return at::kFloat;
}

// The operands: n slots of `count` elements (slot r holds 0.5 * (r + 1)
// everywhere) and their result, in `dtype`, and c = a + b's float arrays,
// sized to move as many bytes as a reduction (it reads n slots and writes one
// result; c = a + b reads two arrays and writes one).
struct ReduceOperands {
  ReduceOperands(int n, std::size_t count, at::ScalarType dtype);
  void reduce() { reduceSlots(type, out.data_ptr(), inputs.data(), weights.data(), n, count); }
  void stream() { streamAdd(c.data(), a.data(), b.data(), stream_count, n); }
  // The mean of 0.5 * (r + 1) over r < n is 0.25 * (n + 1), exact in every dtype for n <= 4.
  bool sumsRight() const;

  int n;
  std::size_t count;
  detail::ElementType type;
  double bytes;  // read and written per reduction
  std::vector<at::Tensor> slots;
  std::vector<const void*> inputs;
  at::Tensor out;
  std::vector<double> weights;
  std::size_t stream_count;
  double stream_bytes;
  std::vector<float> a, b, c;
};

ReduceOperands::ReduceOperands(int n_, std::size_t count_, at::ScalarType dtype)
    : n(n_), count(count_), type(detail::elementTypeOf(dtype)), weights(n_, 1.0 / n_) {
  const std::size_t esize = detail::elementBytes(type);
  bytes = static_cast<double>((n + 1) * count * esize);
  stream_count = std::max<std::size_t>(1, (n + 1) * count * esize / 4 / 3);
  stream_bytes = 3.0 * static_cast<double>(stream_count * sizeof(float));
  const auto size = static_cast<std::int64_t>(count);
  for (int r = 0; r < n; ++r) {
    slots.push_back(at::full({size}, 0.5 * (r + 1), at::TensorOptions().dtype(dtype)));
    inputs.push_back(slots.back().data_ptr());
  }
  out = at::empty({size}, at::TensorOptions().dtype(dtype));
  a.assign(stream_count, 1.0f);
  b.assign(stream_count, 2.0f);
  c.resize(stream_count);
}

bool ReduceOperands::sumsRight() const {
  const float mid = out[static_cast<std::int64_t>(count) / 2].item<float>();
  return !((n <= 4 && mid != 0.25f * static_cast<float>(n + 1)) || mid <= 0 ||
           c[stream_count / 2] != 3.0f);
}

// Milliseconds per call of `fn`, over `repeat` calls in a row.
template <typename Fn>
double timeCalls(int repeat, Fn&& fn) {
  const auto t0 = Clock::now();
  for (int k = 0; k < repeat; ++k) fn();
  return msSince(t0) / repeat;
}

double relErr(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>() /
         std::max(b.to(torch::kDouble).norm().item<double>(), 1e-300);
}

}  // namespace

Row runReduceOnly(const ModelSpec& spec, const Data&, const Config& cfg) {
  const int n = cfg.workers;
  const auto P = static_cast<std::size_t>(paramCount(spec));
  ReduceOperands ops(n, P, reduceDtype(cfg.reduce_dtype));
  // Each sample moves at least ~64 MB, so a small model's reduction is timed
  // over many calls (it then runs from cache, as it would step after step).
  const int repeat = static_cast<int>(std::max(1.0, 64e6 / ops.bytes));
  const int samples = std::max(5, std::min(30, cfg.steps));
  // The portable path (the compiler's loops, no streaming stores: the kernel
  // before the hand-vectorised float32 paths) is timed alongside, for the ratio.
  std::vector<double> reduce_ms, stream_ms, portable_ms;
  for (int s = -1; s < samples; ++s) {  // s == -1: warm-up; interleaved so all see the same noise
    const double r = timeCalls(repeat, [&] { ops.reduce(); });
    const double st = timeCalls(repeat, [&] { ops.stream(); });
    detail::setKernelPathForTests(detail::KernelPath::kPortable);
    const double p = timeCalls(repeat, [&] { ops.reduce(); });
    detail::setKernelPathForTests(detail::KernelPath::kBest);
    if (s < 0) continue;
    reduce_ms.push_back(r);
    stream_ms.push_back(st);
    portable_ms.push_back(p);
  }
  if (!ops.sumsRight()) throw std::logic_error("reduce-only: wrong sums");
  const double gloo = glooAllreduceMs(cfg.placement, n, P, samples, peerThreads(cfg));

  Row row = makeRow(spec, "reduce-only", n, 1, samples);
  row.ms_per_step = median(reduce_ms);
  row.p90_ms = percentile90(reduce_ms);
  row.reduce_ms = row.ms_per_step;
  const double stream = median(stream_ms);
  row.extra["gbps"] = ops.bytes / (row.ms_per_step * 1e6);
  row.extra["gbps_stream"] = ops.stream_bytes / (stream * 1e6);
  row.extra["stream_ms"] = stream;
  row.extra["bandwidth_fraction"] = row.extra["gbps"] / row.extra["gbps_stream"];
  row.extra["portable_ms"] = median(portable_ms);
  row.extra["portable_fraction"] = stream / row.extra["portable_ms"] * ops.bytes / ops.stream_bytes;
  row.extra["gloo_allreduce_ms"] = gloo;
  row.extra["gloo_over_reduce"] = gloo / row.ms_per_step;
  if (cfg.reduce_dtype != "float32") row.mode += "-" + cfg.reduce_dtype;  // reduce-only-bf16
  return row;
}

Row runCheck(const ModelSpec& spec, const Data& data, const Config& cfg) {
  torch::Tensor shm_grad;
  {
    Net model = makeModel(spec);
    gradagg::Options options;
    options.workers = cfg.workers;
    // Gloo peers divide by N (DDP): with unequal shards compare like with like.
    if (spec.batch % cfg.workers != 0) options.weighting = gradagg::Weighting::kEqual;
    gradagg::Aggregator agg(*model, shmShard(model, data, spec), options);
    agg.step();
    shm_grad = flatGrad(model);
  }
  const torch::Tensor gloo_grad = glooGradient(spec, data, cfg);
  torch::Tensor single_grad;
  {
    at::set_num_threads(cfg.threads);
    Net model = makeModel(spec);
    loss(model, data.x, data.y).backward();
    single_grad = flatGrad(model);
  }
  Row row = makeRow(spec, "check", cfg.workers, peerThreads(cfg), 1);
  row.extra["rel_err_shm_gloo"] = relErr(shm_grad, gloo_grad);
  row.extra["rel_err_shm_single"] = relErr(shm_grad, single_grad);
  row.ok = shm_grad.numel() == gloo_grad.numel() && row.extra["rel_err_shm_gloo"] <= 1e-5;
  return row;
}

}  // namespace gradagg::bench
