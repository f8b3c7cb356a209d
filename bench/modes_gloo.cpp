// The gloo mode: --workers forked peers, DDP style. Each computes its shard's
// gradient into one flat buffer (the parameters' .grad are views of it), c10d
// ProcessGroupGloo allreduce, divide by N, then each steps its own optimizer.
// Rank 0's timings come back to the parent through an anonymous shared mapping.
// Also the lone Gloo allreduce the reduce-only and shm-2nodes rows compare with.
#include <cstring>
#include <functional>
#include <vector>

#include <gradagg/blas.h>

#include "forked_peers.h"
#include "gloo_peer.h"
#include "modes.h"
#include "runtime/heap.h"
#include "runtime/temp_dir.h"

namespace gradagg::bench {

namespace {

constexpr auto kPeerTimeout = std::chrono::minutes(10);

// Forks `n` peers that join one Gloo group and run `body(rank, peer)` (with
// `threads` intra-op threads), and waits for them. The group's FileStore lies
// in a fresh directory, removed with everything in it.
void runGlooGroup(const Placement& placement, int n, int threads,
                  const std::function<void(int, GlooPeer&)>& body) {
  detail::TempDir dir("bench");
  ForkedPeers peers;
  peers.spawn(n, [&](int rank) {
    pinTo(placement, rank, n);
    // The heap a long-lived DDP process reaches (glibc's threshold rises to its
    // largest freed chunk) and gradagg's workers get: on a forked child's fresh
    // thread glibc's defaults would unmap its arena's heaps every step (a
    // 5.8M peer's forward and backward took 154 ms instead of ~50).
    detail::keepFreedMemory();
    at::set_num_threads(threads);
    setBlasThreads(threads);
    GlooPeer::Options options;
    options.hostname = enterMachine(placement, rank).address;
    options.store_path = dir.path() + "/store";
    options.rank = rank;
    options.size = n;
    GlooPeer peer(options);
    body(rank, peer);
    peer.barrier();
    return 0;
  });
  peers.join(kPeerTimeout);
}

// `warmup + steps` DDP steps of `n` peers; `keep_grad`: rank 0 keeps its mean
// gradient of step 0.
struct GlooTraining {
  const ModelSpec& spec;
  const Data& data;
  int n, warmup, steps;
  bool keep_grad;
  std::string optimizer = "sgd";  // --optimizer
  int totalSteps() const { return warmup + steps; }
};

struct GlooStepTimes {  // rank 0's; the allreduce times are every rank's, apart
  double total_ms, compute_ms, optimizer_ms;
};

// What the peers leave for the parent, in a mapping made before they fork:
// rank 0's timings, every rank's allreduce time per step (rank-major), rank 0's gradient.
struct GlooRecord {
  GlooRecord(const GlooTraining& run, std::int64_t params);
  detail::Segment segment;
  GlooStepTimes* times;
  double* allreduce_of;
  float* grad;
};

GlooRecord::GlooRecord(const GlooTraining& run, std::int64_t params) {
  const int total_steps = run.totalSteps();
  times = static_cast<GlooStepTimes*>(
      sharedMapping(segment, sizeof(GlooStepTimes) * total_steps +
                                 sizeof(double) * run.n * total_steps + sizeof(float) * params));
  allreduce_of = reinterpret_cast<double*>(times + total_steps);
  grad = reinterpret_cast<float*>(allreduce_of + run.n * total_steps);
}

// The gradients as views of one flat buffer (DDP's gradient_as_bucket_view):
// backward accumulates into it, the allreduce works on it in place.
torch::Tensor bindFlatGrad(Net& model, std::int64_t params) {
  torch::Tensor flat = torch::zeros({params});
  std::int64_t offset = 0;
  for (auto& p : model->parameters()) {
    p.mutable_grad() = flat.narrow(0, offset, p.numel()).view(p.sizes());
    offset += p.numel();
  }
  return flat;
}

// Peer `rank`'s steps, in the forked child.
void trainPeer(const GlooTraining& run, Net& model, int rank, GlooPeer& peer, GlooRecord& out) {
  using Ms = std::chrono::duration<double, std::milli>;
  const std::int64_t P = paramCount(run.spec);
  const int total_steps = run.totalSteps();
  auto opt = makeOptimizer(run.optimizer, model);
  torch::Tensor flat = bindFlatGrad(model, P);
  const Shard sh = shardOf(run.spec.batch, rank, run.n);
  const torch::Tensor xs = run.data.x.slice(0, sh.begin, sh.end);
  const torch::Tensor ys = run.data.y.slice(0, sh.begin, sh.end);
  for (int s = 0; s < total_steps; ++s) {
    const auto t0 = Clock::now();
    flat.zero_();
    loss(model, xs, ys).backward();
    const auto t1 = Clock::now();
    peer.allreduceSum(flat);
    const auto t2 = Clock::now();
    flat.div_(run.n);
    if (run.keep_grad && rank == 0 && s == 0)
      std::memcpy(out.grad, flat.data_ptr<float>(), sizeof(float) * P);
    opt->step();
    out.allreduce_of[rank * total_steps + s] = Ms(t2 - t1).count();
    if (rank == 0) out.times[s] = {msSince(t0), Ms(t1 - t0).count(), msSince(t2)};
  }
}

void trainGloo(const GlooTraining& run, const Config& cfg, GlooRecord& out) {
  Net model = makeModel(run.spec);
  runGlooGroup(cfg.placement, run.n, peerThreads(cfg),
               [&](int rank, GlooPeer& peer) { trainPeer(run, model, rank, peer, out); });
}

Row glooRow(const GlooTraining& run, const GlooRecord& rec, int threads) {
  const int total_steps = run.totalSteps();
  std::vector<double> total, compute, allreduce, optimizer, last;
  for (int s = run.warmup; s < total_steps; ++s) {
    last.push_back(lastArrival(rec.allreduce_of + s, run.n, total_steps));
    total.push_back(rec.times[s].total_ms);
    compute.push_back(rec.times[s].compute_ms);
    allreduce.push_back(rec.allreduce_of[s]);  // rank 0's
    optimizer.push_back(rec.times[s].optimizer_ms);
  }
  Row row = makeRow(run.spec, "gloo", run.n, threads, run.steps);
  row.ms_per_step = median(total);
  row.p90_ms = percentile90(total);
  row.reduce_ms = median(allreduce);
  row.sync_us = 1000 * row.reduce_ms;
  row.extra["compute_ms"] = median(compute);
  row.extra["optimizer_ms"] = median(optimizer);
  row.extra["allreduce_last_ms"] = median(last);
  return row;
}

}  // namespace

Row runGloo(const ModelSpec& spec, const Data& data, const Config& cfg) {
  const GlooTraining run{spec, data, cfg.workers, cfg.warmup, cfg.steps, false, cfg.optimizer};
  GlooRecord rec(run, paramCount(spec));
  trainGloo(run, cfg, rec);
  return glooRow(run, rec, peerThreads(cfg));
}

torch::Tensor glooGradient(const ModelSpec& spec, const Data& data, const Config& cfg) {
  const GlooTraining run{spec, data, cfg.workers, 0, 1, true};
  const std::int64_t P = paramCount(spec);
  GlooRecord rec(run, P);
  trainGloo(run, cfg, rec);
  return torch::from_blob(rec.grad, {P}, torch::kFloat).clone();
}

double glooAllreduceMs(const Placement& placement, int n, std::size_t count, int samples,
                       int threads) {
  const int iterations = 3 + samples;
  detail::Segment shared;
  auto* ms = static_cast<double*>(sharedMapping(shared, sizeof(double) * iterations));
  runGlooGroup(placement, n, threads, [&](int rank, GlooPeer& peer) {
    torch::Tensor t = torch::empty({static_cast<std::int64_t>(count)});
    for (int s = 0; s < iterations; ++s) {
      t.fill_(1.0f);
      const auto t0 = Clock::now();
      peer.allreduceSum(t);
      if (rank == 0) ms[s] = msSince(t0);
    }
  });
  return median(std::vector<double>(ms + 3, ms + iterations));
}

}  // namespace gradagg::bench
