// gradagg-bench: the same model and global batch trained, side by side in one
// run, by
//   single       one process (forward, backward, optimizer step);
//   shm          gradagg::Aggregator with N forked workers, then optimizer.step();
//   gloo         N forked peers, DDP style: each computes its shard's gradient
//                into one flat buffer, c10d ProcessGroupGloo allreduce, divide
//                by N, each steps its own optimizer;
// and the reduction alone (reduce-only): N slots of P floats summed by gradagg's
// kernel, next to a streaming c = a + b over as many bytes and a Gloo allreduce
// of the same buffer. --check compares one step's mean gradient of shm and gloo.
// See bench/README.md for the columns.
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>
#include <CLI/CLI.hpp>

#include <gradagg/gradagg.h>

#include "model/model_binding.h"
#include "runtime/temp_dir.h"
#include "forked_peers.h"
#include "gloo_peer.h"
#include "kernels.h"
#include "report.h"

namespace gradagg::bench {
namespace {

using Clock = std::chrono::steady_clock;
double msSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

constexpr double kLearningRate = 0.01;
constexpr std::uint64_t kSeed = 20240601;
constexpr auto kPeerTimeout = std::chrono::minutes(10);
const std::vector<std::string> kModes = {"single",     "shm",        "gloo",
                                         "shm-1node",  "shm-2nodes", "shm-2nodes-bf16",
                                         "shm-2nodes-after", "reduce-only"};

// ---- models and data -------------------------------------------------------

struct ModelSpec {
  std::string name;  // layer list, e.g. "784-64-64-10"
  std::vector<std::int64_t> layers;
  std::int64_t batch = 256;
};

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const std::vector<std::int64_t>& layers) {
    for (std::size_t i = 0; i + 1 < layers.size(); ++i)
      fc.push_back(
          register_module("fc" + std::to_string(i), torch::nn::Linear(layers[i], layers[i + 1])));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < fc.size(); ++i) {
      x = fc[i]->forward(x);
      if (i + 1 < fc.size()) x = torch::relu(x);
    }
    return x;
  }
  std::vector<torch::nn::Linear> fc;
};
TORCH_MODULE(Mlp);

// Every mode starts from the same parameters and trains on the same data.
Mlp makeModel(const ModelSpec& spec) {
  torch::manual_seed(kSeed);
  return Mlp(spec.layers);
}

struct Data {
  torch::Tensor x, y;
};

Data makeData(const ModelSpec& spec) {
  torch::manual_seed(kSeed + 1);
  return {torch::randn({spec.batch, spec.layers.front()}),
          torch::randint(0, spec.layers.back(), {spec.batch}, torch::kLong)};
}

// Rank r of n owns rows [begin, end) of the global batch.
struct Shard {
  std::int64_t begin, end;
};
Shard shardOf(std::int64_t batch, int rank, int n) {
  return {batch * rank / n, batch * (rank + 1) / n};
}

std::int64_t paramCount(const ModelSpec& spec) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i + 1 < spec.layers.size(); ++i)
    n += spec.layers[i] * spec.layers[i + 1] + spec.layers[i + 1];
  return n;
}

torch::Tensor loss(Mlp& model, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::cross_entropy_loss(model->forward(x), y);
}

// All parameters' .grad, concatenated (a copy).
torch::Tensor flatGrad(Mlp& model) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : model->parameters()) parts.push_back(p.grad().detach().flatten());
  return torch::cat(parts).clone();
}

// ---- configuration -----------------------------------------------------------

struct Config {
  int workers = 2;
  int steps = 20;
  int warmup = 3;
  int threads = 0;         // single mode; 0: all cores
  std::int64_t batch = 0;  // 0: the model's default
  std::vector<ModelSpec> models;
  std::set<std::string> modes;
  std::string json;
  bool check = false;
  bool short_run = false;
  int cores = 1;
  std::string reduce_dtype = "float32";  // reduce-only: float32, bf16 or fp16
  int accumulate = 1;                    // shm: micro-batches per worker and step
};

int peerThreads(const Config& cfg) { return std::max(1, cfg.cores / cfg.workers); }

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

ModelSpec parseModel(const std::string& token) {
  if (token == "807") return {"784-1-1-10", {784, 1, 1, 10}, 16};
  if (token == "55k") return {"784-64-64-10", {784, 64, 64, 10}, 256};
  if (token == "670k") return {"784-512-512-10", {784, 512, 512, 10}, 256};
  if (token == "5.8m") return {"784-2048-2048-10", {784, 2048, 2048, 10}, 256};
  ModelSpec spec{token, {}, 256};
  for (const std::string& width : split(token, '-')) {
    std::size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(width, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != width.size() || v <= 0)
      throw CLI::ValidationError(
          "--model",
          "'" + token + "': expected all, 807, 55k, 670k, 5.8m or a layer list like 784-64-64-10");
    spec.layers.push_back(v);
  }
  if (spec.layers.size() < 2)
    throw CLI::ValidationError("--model",
                               "'" + token + "': a layer list needs at least two widths");
  if (spec.layers.back() < 2)
    throw CLI::ValidationError("--model",
                               "'" + token + "': the last width is the class count, at least 2");
  return spec;
}

Row makeRow(const ModelSpec& spec, const char* mode, int workers, int threads, int steps) {
  Row row;
  row.model = spec.name;
  row.mode = mode;
  row.workers = workers;
  row.params = paramCount(spec);
  row.batch = spec.batch;
  row.threads = threads;
  row.steps = steps;
  return row;
}

// ---- single ------------------------------------------------------------------

Row runSingle(const ModelSpec& spec, const Data& data, const Config& cfg) {
  at::set_num_threads(cfg.threads);
  Mlp model = makeModel(spec);
  torch::optim::SGD opt(model->parameters(), kLearningRate);
  std::vector<double> total, compute;
  for (int s = 0; s < cfg.warmup + cfg.steps; ++s) {
    const auto t0 = Clock::now();
    opt.zero_grad();
    loss(model, data.x, data.y).backward();
    const double c = msSince(t0);
    opt.step();
    if (s < cfg.warmup) continue;
    total.push_back(msSince(t0));
    compute.push_back(c);
  }
  Row row = makeRow(spec, "single", 1, cfg.threads, cfg.steps);
  row.ms_per_step = median(total);
  row.p90_ms = percentile90(total);
  row.extra["compute_ms"] = median(compute);
  return row;
}

// ---- shm (gradagg) -------------------------------------------------------------

// The shard function of the gradagg modes: global worker g of G takes its share
// of the batch (on one node the global rank is the rank); accumulating, its
// micro-batch i of k is the i-th k-th of that share.
gradagg::ShardFn shmShard(Mlp& model, const Data& data, const ModelSpec& spec) {
  return [&model, &data, &spec](const gradagg::ShardContext& ctx) {
    const Shard sh = shardOf(spec.batch, ctx.global_rank, ctx.global_workers);
    const std::int64_t len = sh.end - sh.begin;
    const std::int64_t begin = sh.begin + len * ctx.micro_step / ctx.micro_steps;
    const std::int64_t end = sh.begin + len * (ctx.micro_step + 1) / ctx.micro_steps;
    return gradagg::ShardResult{
        loss(model, data.x.slice(0, begin, end), data.y.slice(0, begin, end)), end - begin};
  };
}

Row runShm(const ModelSpec& spec, const Data& data, const Config& cfg) {
  Mlp model = makeModel(spec);
  torch::optim::SGD opt(model->parameters(), kLearningRate);
  gradagg::Options options;
  options.workers = cfg.workers;
  options.accumulation_steps = cfg.accumulate;
  gradagg::Aggregator agg(*model, shmShard(model, data, spec), options);
  std::vector<double> total, reduce, sync, compute, publish, worker, optimizer, slot_ms;
  // The per-phase breakdown of a step (worker 0's phases; the parent's publish and apply).
  std::map<std::string, std::vector<double>> phases;
  for (int s = 0; s < cfg.warmup + cfg.steps; ++s) {
    const auto t0 = Clock::now();
    const gradagg::StepReport& r = agg.step();
    const auto t1 = Clock::now();
    opt.step();
    if (s < cfg.warmup) continue;
    total.push_back(msSince(t0));
    optimizer.push_back(msSince(t1));
    // Work: the slowest worker's own phases (snapshot load and slot zeroing,
    // shard function, backward, slot checks, its range of the reduction).
    // Synchronisation: the rest of step() (wake-ups, barrier waits, publish, apply).
    double slowest = 0, busiest = 0, slot = 0;
    for (const gradagg::WorkerReport& w : r.workers) {
      slowest = std::max(slowest, w.shard_ms + w.backward_ms);
      busiest =
          std::max(busiest, w.load_ms + w.shard_ms + w.backward_ms + w.write_ms + w.reduce_ms);
      slot = std::max(slot, w.load_ms + w.write_ms);
    }
    reduce.push_back(r.reduce_ms);
    sync.push_back(1000 * (r.total_ms - busiest));
    slot_ms.push_back(slot);
    compute.push_back(r.compute_ms);
    publish.push_back(r.publish_ms);
    worker.push_back(slowest);
    const gradagg::WorkerReport& w0 = r.workers.front();
    for (const auto& [name, value] : {std::pair<const char*, double>{"phase_wake_ms", w0.wake_ms},
                                      {"phase_load_ms", w0.load_ms},
                                      {"phase_shard_ms", w0.shard_ms},
                                      {"phase_backward_ms", w0.backward_ms},
                                      {"phase_write_ms", w0.write_ms},
                                      {"phase_barrier_ms", w0.barrier_ms},
                                      {"phase_reduce_ms", w0.reduce_ms},
                                      {"phase_apply_ms", r.apply_ms}})
      phases[name].push_back(value);
  }
  Row row = makeRow(spec, "shm", cfg.workers, agg.options().resolvedThreadsPerWorker(), cfg.steps);
  row.ms_per_step = median(total);
  row.p90_ms = percentile90(total);
  row.reduce_ms = median(reduce);
  row.sync_us = median(sync);
  row.extra["compute_ms"] = median(compute);
  row.extra["worker_ms"] = median(worker);
  row.extra["slot_ms"] = median(slot_ms);
  row.extra["publish_ms"] = median(publish);
  row.extra["optimizer_ms"] = median(optimizer);
  for (auto& [name, values] : phases) row.extra[name] = median(values);
  if (cfg.accumulate > 1) row.mode += "-acc" + std::to_string(cfg.accumulate);  // shm-acc4
  return row;
}

// ---- shm across 2 nodes on loopback ------------------------------------------------
// Two process trees (nodes), each an Aggregator with max(1, workers / 2) workers,
// joined through c10d Gloo: the cross-node step (StepReport::node_ms) next to the
// in-node reduction and to one Gloo allreduce of the same P floats between two
// forked processes, measured in the same run. Each node sends and receives about
// P x 4 bytes per step (a ring allreduce of 2 nodes); the status rides in the
// same buffer (8 + parameter tensors floats).
Row runNodes(const ModelSpec& spec, const Data& data, const Config& cfg,
             gradagg::Compression compression, bool overlap);
double glooAllreduceMs(int n, std::size_t count, int samples, int threads);

// One step's collective as the process that reached it last saw it: the least
// of the n processes' times (values[k * stride]). The others also waited there
// for the slower one's compute; the last one waited for the collective alone.
double lastArrival(const double* values, int n, int stride) {
  double least = values[0];
  for (int k = 1; k < n; ++k) least = std::min(least, values[k * stride]);
  return least;
}

// ---- an emulated cluster (tests/cluster/cluster.sh) ------------------------------
// With --cluster PREFIX (from `cluster.sh up 2 RATE`) every forked node and Gloo
// peer k enters machine k % 2's network namespace (PREFIXn<m>) and talks over its
// rate-limited veth (PREFIXv<m>, 10.213.0.<m+1>): the cross-node traffic of the
// shm-2nodes and gloo rows crosses the emulated link. Without it: loopback.
std::string g_cluster;

struct ClusterMachine {
  std::string interface, address;
};

// In a forked child, before it creates a socket. setns() moves the calling thread
// (the child's only one so far); threads it starts later inherit the namespace.
ClusterMachine enterMachine(int k) {
  if (g_cluster.empty()) return {"lo", "127.0.0.1"};
  const int m = k % 2;
  const std::string ns = "/run/netns/" + g_cluster + "n" + std::to_string(m);
  const int fd = ::open(ns.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0)
    throw std::system_error(errno, std::generic_category(), "gradagg-bench: entering " + ns);
  ::close(fd);
  return {g_cluster + "v" + std::to_string(m), "10.213.0." + std::to_string(m + 1)};
}

// ---- --pin: each node or peer on CPUs of its own ---------------------------------
// Part k of n of the CPUs this process may use, for a forked node or Gloo peer
// k (round robin when there are more processes than CPUs): processes of
// different nodes then never share a core, as when each node of a host is
// given its own CPUs (taskset, a launcher's CPU binding). Without it the
// kernel places them (docs/benchmark.md: small steps across nodes are slower
// then; why is not traced).
bool g_pin = false;

void pinTo(int k, int n) {
  if (!g_pin) return;
  cpu_set_t all;
  CPU_ZERO(&all);
  if (::sched_getaffinity(0, sizeof(all), &all) != 0)
    throw std::system_error(errno, std::generic_category(), "gradagg-bench: sched_getaffinity");
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &all)) cpus.push_back(c);
  const int count = static_cast<int>(cpus.size());
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (count >= n) {
    for (int i = k * count / n; i < (k + 1) * count / n; ++i) CPU_SET(cpus[i], &mine);
  } else {
    CPU_SET(cpus[k % count], &mine);
  }
  if (::sched_setaffinity(0, sizeof(mine), &mine) != 0)
    throw std::system_error(errno, std::generic_category(), "gradagg-bench: sched_setaffinity");
}

// ---- gloo (forked peers, DDP style) ---------------------------------------------

// A fresh directory for one group's FileStore, removed with everything in it.
using detail::TempDir;

// Forks `n` peers that join one Gloo group and run `body(rank, peer)` (with
// `threads` intra-op threads), and waits for them.
void runGlooGroup(int n, int threads, const std::function<void(int, GlooPeer&)>& body) {
  TempDir dir("bench");
  ForkedPeers peers;
  peers.spawn(n, [&](int rank) {
    pinTo(rank, n);
    at::set_num_threads(threads);
    GlooPeer::Options options;
    options.hostname = enterMachine(rank).address;
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

struct GlooStepTimes {  // rank 0's; the allreduce times are every rank's, apart
  double total_ms, compute_ms, optimizer_ms;
};

// Trains `warmup + steps` steps DDP style. Rank 0's timings come back through a
// shared mapping, and so does its mean gradient of step 0 when `first_grad`.
Row runGloo(const ModelSpec& spec, const Data& data, const Config& cfg, int warmup, int steps,
            torch::Tensor* first_grad = nullptr) {
  const int n = cfg.workers;
  const int total_steps = warmup + steps;
  const std::int64_t P = paramCount(spec);
  Mlp model = makeModel(spec);
  detail::Segment shared;
  // Rank 0's timings, then every rank's allreduce time per step (rank-major).
  auto* times = static_cast<GlooStepTimes*>(sharedMapping(
      shared, sizeof(GlooStepTimes) * total_steps + sizeof(double) * n * total_steps +
                  sizeof(float) * P));
  auto* allreduce_of = reinterpret_cast<double*>(times + total_steps);
  auto* grad_out = reinterpret_cast<float*>(allreduce_of + n * total_steps);

  runGlooGroup(n, peerThreads(cfg), [&](int rank, GlooPeer& peer) {
    torch::optim::SGD opt(model->parameters(), kLearningRate);
    // The gradients are views of one flat buffer (DDP's gradient_as_bucket_view):
    // backward accumulates into it, the allreduce works on it in place.
    torch::Tensor flat = torch::zeros({P});
    std::int64_t offset = 0;
    for (auto& p : model->parameters()) {
      p.mutable_grad() = flat.narrow(0, offset, p.numel()).view(p.sizes());
      offset += p.numel();
    }
    const Shard sh = shardOf(spec.batch, rank, n);
    const torch::Tensor xs = data.x.slice(0, sh.begin, sh.end);
    const torch::Tensor ys = data.y.slice(0, sh.begin, sh.end);
    for (int s = 0; s < total_steps; ++s) {
      const auto t0 = Clock::now();
      flat.zero_();
      loss(model, xs, ys).backward();
      const auto t1 = Clock::now();
      peer.allreduceSum(flat);
      const auto t2 = Clock::now();
      flat.div_(n);
      if (first_grad && rank == 0 && s == 0)
        std::memcpy(grad_out, flat.data_ptr<float>(), sizeof(float) * P);
      opt.step();
      using Ms = std::chrono::duration<double, std::milli>;
      allreduce_of[rank * total_steps + s] = Ms(t2 - t1).count();
      if (rank == 0)
        times[s] = {msSince(t0), Ms(t1 - t0).count(), msSince(t2)};
    }
  });

  if (first_grad) *first_grad = torch::from_blob(grad_out, {P}, torch::kFloat).clone();
  std::vector<double> total, compute, allreduce, optimizer, last;
  for (int s = warmup; s < total_steps; ++s) {
    last.push_back(lastArrival(allreduce_of + s, n, total_steps));
    total.push_back(times[s].total_ms);
    compute.push_back(times[s].compute_ms);
    allreduce.push_back(allreduce_of[s]);  // rank 0's
    optimizer.push_back(times[s].optimizer_ms);
  }
  Row row = makeRow(spec, "gloo", n, peerThreads(cfg), steps);
  if (steps == 0) return row;
  row.ms_per_step = median(total);
  row.p90_ms = percentile90(total);
  row.reduce_ms = median(allreduce);
  row.sync_us = 1000 * row.reduce_ms;
  row.extra["compute_ms"] = median(compute);
  row.extra["optimizer_ms"] = median(optimizer);
  row.extra["allreduce_last_ms"] = median(last);
  return row;
}

// compression: the float32 gradients cross as bf16 (mode shm-2nodes-bf16);
// without overlap the same buckets cross after backward (shm-2nodes-after).
Row runNodes(const ModelSpec& spec, const Data& data, const Config& cfg,
             gradagg::Compression compression, bool overlap) {
  struct NodeTimes {
    double total_ms, node_ms, reduce_ms;
    std::uint64_t node_bytes;
    int collectives, overlapped;
  };
  const int per_node = std::max(1, cfg.workers / 2);
  const int total_steps = cfg.warmup + cfg.steps;
  TempDir dir("bench");
  detail::Segment shared;
  // Node 0's timings, then node 1's.
  auto* times = static_cast<NodeTimes*>(sharedMapping(shared, sizeof(NodeTimes) * 2 * total_steps));
  ForkedPeers nodes;
  nodes.spawn(2, [&](int node) {
    const ClusterMachine machine = enterMachine(node);
    pinTo(node, 2);
    Mlp model = makeModel(spec);
    torch::optim::SGD opt(model->parameters(), kLearningRate);
    gradagg::Options options;
    options.workers = per_node;
    options.nodes.nodes = 2;
    options.nodes.node_rank = node;
    options.nodes.store_path = dir.path() + "/store";
    options.nodes.interface = machine.interface;
    options.nodes.checksum_interval = 0;
    options.nodes.compression = compression;
    options.nodes.overlap = overlap;
    gradagg::Aggregator agg(*model, shmShard(model, data, spec), options);
    for (int s = 0; s < total_steps; ++s) {
      const auto t0 = Clock::now();
      const gradagg::StepReport& r = agg.step();
      opt.step();
      times[node * total_steps + s] = NodeTimes{
          msSince(t0), r.node_ms, r.reduce_ms, r.node_bytes, r.node_collectives, r.node_overlapped};
    }
    return 0;
  });
  nodes.join(std::chrono::minutes(30));
  std::vector<double> total, node_ms, reduce, last;
  for (int s = cfg.warmup; s < total_steps; ++s) {
    const double of[2] = {times[s].node_ms, times[total_steps + s].node_ms};
    last.push_back(lastArrival(of, 2, 1));
    total.push_back(times[s].total_ms);
    node_ms.push_back(times[s].node_ms);
    reduce.push_back(times[s].reduce_ms);
  }
  const bool bf16 = compression == gradagg::Compression::kBFloat16;
  Row row = makeRow(spec,
                    bf16       ? "shm-2nodes-bf16"
                    : !overlap ? "shm-2nodes-after"
                               : "shm-2nodes",
                    2 * per_node, 1, cfg.steps);
  row.ms_per_step = median(total);
  row.p90_ms = percentile90(total);
  row.reduce_ms = median(reduce);
  row.sync_us = 1000 * median(node_ms);
  row.extra["node_ms"] = median(node_ms);
  // What this node put into the step's collectives (StepReport::node_bytes).
  row.extra["bytes_per_node_per_step"] = static_cast<double>(times[total_steps - 1].node_bytes);
  // The collectives of a step, and how many of them started during backward.
  row.extra["collectives"] = times[total_steps - 1].collectives;
  double overlapped = 0;
  for (int s = cfg.warmup; s < total_steps; ++s) overlapped += times[s].overlapped;
  row.extra["overlapped_per_step"] = overlapped / std::max(1, cfg.steps);
  const double gloo =
      glooAllreduceMs(2, static_cast<std::size_t>(paramCount(spec)), std::max(cfg.steps, 50), 1);
  row.extra["gloo_allreduce_ms"] = gloo;
  row.extra["node_over_gloo"] = median(node_ms) / gloo;
  row.extra["node_last_ms"] = median(last);
  row.extra["node_last_over_gloo"] = median(last) / gloo;
  return row;
}

// ---- reduce-only -------------------------------------------------------------------

// The median time of one Gloo allreduce of `count` floats among n forked
// processes, over `samples` calls after 3 unmeasured ones.
double glooAllreduceMs(int n, std::size_t count, int samples, int threads) {
  const int iterations = 3 + samples;
  detail::Segment shared;
  auto* ms = static_cast<double*>(sharedMapping(shared, sizeof(double) * iterations));
  runGlooGroup(n, threads, [&](int rank, GlooPeer& peer) {
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

// Median over `samples` timings of `repeat` calls of `fn`, in ms per call.
template <typename Fn>
std::vector<double> timeCalls(int samples, int repeat, Fn&& fn) {
  std::vector<double> ms;
  for (int s = 0; s < samples; ++s) {
    const auto t0 = Clock::now();
    for (int k = 0; k < repeat; ++k) fn();
    ms.push_back(msSince(t0) / repeat);
  }
  return ms;
}

Row runReduceOnly(const ModelSpec& spec, const Config& cfg) {
  const int n = cfg.workers;
  const auto P = static_cast<std::size_t>(paramCount(spec));
  const at::ScalarType dtype = cfg.reduce_dtype == "bf16"   ? at::kBFloat16
                               : cfg.reduce_dtype == "fp16" ? at::kHalf
                                                            : at::kFloat;
  const detail::ElementType type = detail::elementTypeOf(dtype);
  const std::size_t esize = detail::elementBytes(type);
  // The reduction reads n slots and writes one result; c = a + b reads two
  // arrays and writes one: size it to move as many bytes.
  const double bytes = static_cast<double>((n + 1) * P * esize);
  const std::size_t stream_count = std::max<std::size_t>(1, (n + 1) * P * esize / 4 / 3);
  const double stream_bytes = 3.0 * static_cast<double>(stream_count * sizeof(float));

  // Slot r holds 0.5 * (r + 1) everywhere, in the chosen dtype.
  const auto size = static_cast<std::int64_t>(P);
  std::vector<at::Tensor> slots;
  std::vector<const void*> inputs;
  for (int r = 0; r < n; ++r) {
    slots.push_back(at::full({size}, 0.5 * (r + 1), at::TensorOptions().dtype(dtype)));
    inputs.push_back(slots.back().data_ptr());
  }
  at::Tensor out = at::empty({size}, at::TensorOptions().dtype(dtype));
  std::vector<float> a(stream_count, 1.0f), b(stream_count, 2.0f), c(stream_count);
  const std::vector<double> weights(n, 1.0 / n);

  // Each sample moves at least ~64 MB, so a small model's reduction is timed
  // over many calls (it then runs from cache, as it would step after step).
  const int repeat = static_cast<int>(std::max(1.0, 64e6 / bytes));
  const int samples = std::max(5, std::min(30, cfg.steps));
  std::vector<double> reduce_ms, stream_ms;
  for (int s = -1; s < samples; ++s) {  // s == -1: warm-up; interleaved so both see the same noise
    const auto r = timeCalls(
        1, repeat, [&] { reduceSlots(type, out.data_ptr(), inputs.data(), weights.data(), n, P); });
    const auto st =
        timeCalls(1, repeat, [&] { streamAdd(c.data(), a.data(), b.data(), stream_count, n); });
    if (s < 0) continue;
    reduce_ms.push_back(r[0]);
    stream_ms.push_back(st[0]);
  }
  // The mean of 0.5 * (r + 1) over r < n is 0.25 * (n + 1), exact in every dtype for n <= 4.
  const float mid = out[size / 2].item<float>();
  if ((n <= 4 && mid != 0.25f * static_cast<float>(n + 1)) || mid <= 0 ||
      c[stream_count / 2] != 3.0f)
    throw std::logic_error("reduce-only: wrong sums");

  const double gloo = glooAllreduceMs(n, P, samples, peerThreads(cfg));

  Row row = makeRow(spec, "reduce-only", n, 1, samples);
  row.ms_per_step = median(reduce_ms);
  row.p90_ms = percentile90(reduce_ms);
  row.reduce_ms = row.ms_per_step;
  const double stream = median(stream_ms);
  row.extra["gbps"] = bytes / (row.ms_per_step * 1e6);
  row.extra["gbps_stream"] = stream_bytes / (stream * 1e6);
  row.extra["stream_ms"] = stream;
  row.extra["bandwidth_fraction"] = row.extra["gbps"] / row.extra["gbps_stream"];
  row.extra["gloo_allreduce_ms"] = gloo;
  row.extra["gloo_over_reduce"] = gloo / row.ms_per_step;
  if (cfg.reduce_dtype != "float32") row.mode += "-" + cfg.reduce_dtype;  // reduce-only-bf16
  return row;
}

// ---- check ---------------------------------------------------------------------------

// One step's mean gradient from the same parameters and data: shm against gloo
// (and, for information, against single-process full-batch autograd).
Row runCheck(const ModelSpec& spec, const Data& data, const Config& cfg) {
  torch::Tensor shm_grad;
  {
    Mlp model = makeModel(spec);
    gradagg::Options options;
    options.workers = cfg.workers;
    // Gloo peers divide by N (DDP): with unequal shards compare like with like.
    if (spec.batch % cfg.workers != 0) options.weighting = gradagg::Weighting::kEqual;
    gradagg::Aggregator agg(*model, shmShard(model, data, spec), options);
    agg.step();
    shm_grad = flatGrad(model);
  }
  torch::Tensor gloo_grad;
  runGloo(spec, data, cfg, 0, 1, &gloo_grad);
  torch::Tensor single_grad;
  {
    at::set_num_threads(cfg.threads);
    Mlp model = makeModel(spec);
    loss(model, data.x, data.y).backward();
    single_grad = flatGrad(model);
  }
  auto relErr = [](const torch::Tensor& a, const torch::Tensor& b) {
    return (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>() /
           std::max(b.to(torch::kDouble).norm().item<double>(), 1e-300);
  };
  Row row = makeRow(spec, "check", cfg.workers, peerThreads(cfg), 1);
  row.extra["rel_err_shm_gloo"] = relErr(shm_grad, gloo_grad);
  row.extra["rel_err_shm_single"] = relErr(shm_grad, single_grad);
  row.ok = shm_grad.numel() == gloo_grad.numel() && row.extra["rel_err_shm_gloo"] <= 1e-5;
  return row;
}

// ---- main ------------------------------------------------------------------------------

int run(int argc, char** argv) {
  Config cfg;
  cfg.cores = gradagg::availableCores();
  std::string models = "all", modes = "all";
  CLI::App app{
      "gradagg-bench: single process vs gradagg (shm) vs forked Gloo peers, and the "
      "reduction alone; one markdown row per (model, mode)"};
  app.add_option("-w,--workers", cfg.workers, "worker processes for shm, gloo and reduce-only")
      ->check(CLI::Range(1, gradagg::Options::kMaxWorkers));
  auto* steps_opt = app.add_option("-s,--steps", cfg.steps, "measured steps per configuration")
                        ->check(CLI::PositiveNumber);
  auto* warmup_opt = app.add_option("--warmup", cfg.warmup, "unmeasured steps first")
                         ->check(CLI::NonNegativeNumber);
  app.add_option("-m,--model", models,
                 "comma list of all, 807, 55k, 670k, 5.8m or layer lists like 784-64-64-10");
  app.add_option("-b,--batch", cfg.batch,
                 "global batch for every model (default 16 for 807, 256 otherwise)")
      ->check(CLI::PositiveNumber);
  app.add_option("-t,--threads", cfg.threads,
                 "intra-op threads in single mode (default: all cores)")
      ->check(CLI::PositiveNumber);
  app.add_option("--modes", modes,
                 "comma list of single, shm, gloo, shm-1node, shm-2nodes, shm-2nodes-bf16, "
                 "shm-2nodes-after (overlap off), reduce-only (default all)");
  app.add_flag("--pin", g_pin,
               "give each node (shm-2nodes*) and each Gloo peer its own part of the CPUs "
               "(sched_setaffinity), as taskset per node would");
  app.add_option("--cluster", g_cluster,
                 "run the nodes and Gloo peers in an emulated cluster's namespaces (the prefix "
                 "`tests/cluster/cluster.sh up 2 RATE` prints), over its limited link");
  app.add_option("--json", cfg.json, "write one JSON object per configuration (JSON Lines) here");
  app.add_option("--accumulate", cfg.accumulate,
                 "shm: each worker's share of the batch as this many micro-batches, accumulated "
                 "(Options::accumulation_steps)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--reduce-dtype", cfg.reduce_dtype,
                 "element type of the reduce-only slots: float32, bf16 or fp16")
      ->check(CLI::IsMember({"float32", "bf16", "fp16"}));
  app.add_flag("--short", cfg.short_run,
               "CI smoke run: 3 steps, 1 warm-up, only the 807 and 55k models");
  app.add_flag("--check", cfg.check,
               "also compare one step's mean gradient of shm and gloo on the 807 and 55k models; "
               "exit 1 if they differ");
  try {
    app.parse(argc, argv);
    if (cfg.short_run) {
      if (!steps_opt->count()) cfg.steps = 3;
      if (!warmup_opt->count()) cfg.warmup = 1;
      if (models == "all") models = "807,55k";
    }
    for (const std::string& token : split(models, ',')) {
      if (token == "all") {
        for (const char* name : {"807", "55k", "670k", "5.8m"})
          cfg.models.push_back(parseModel(name));
      } else {
        cfg.models.push_back(parseModel(token));
      }
    }
    for (const std::string& m : split(modes, ',')) {
      if (m == "all") {
        cfg.modes.insert(kModes.begin(), kModes.end());
      } else if (std::find(kModes.begin(), kModes.end(), m) != kModes.end()) {
        cfg.modes.insert(m);
      } else {
        throw CLI::ValidationError(
            "--modes", "'" + m +
                "': expected single, shm, gloo, shm-1node, shm-2nodes, shm-2nodes-bf16, "
                "shm-2nodes-after, reduce-only or all");
      }
    }
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (cfg.threads == 0) cfg.threads = cfg.cores;
  for (ModelSpec& spec : cfg.models)
    if (cfg.batch > 0) spec.batch = cfg.batch;
  for (const ModelSpec& spec : cfg.models)
    if (spec.batch < cfg.workers)
      throw std::invalid_argument("batch " + std::to_string(spec.batch) + " of model " + spec.name +
                                  " is smaller than --workers " + std::to_string(cfg.workers));

  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  const Machine machine = probeMachine(TORCH_VERSION);
  printMachine(std::cout, machine, command);
  std::cout << "workers " << cfg.workers << ", " << cfg.steps << " steps after " << cfg.warmup
            << " warm-up, single-process threads " << cfg.threads << ", peer threads "
            << peerThreads(cfg) << "\n\n"
            << std::flush;

  std::ofstream json;
  if (!cfg.json.empty()) {
    json.open(cfg.json, std::ios::trunc);
    if (!json) throw std::runtime_error("cannot write " + cfg.json);
  }
  std::vector<Row> rows;
  auto record = [&](Row row) {
    if (row.mode != "check" && row.mode.rfind("reduce-only", 0) != 0 && row.ms_per_step > 0)
      row.samples_per_s = 1000.0 * static_cast<double>(row.batch) / row.ms_per_step;
    std::cerr << "  " << row.model << " " << row.mode << ": " << row.ms_per_step << " ms\n";
    rows.push_back(row);
    if (json) json << toJsonLine(row, machine) << "\n" << std::flush;
  };

  for (const ModelSpec& spec : cfg.models) {
    std::cerr << "model " << spec.name << " (" << paramCount(spec) << " params, batch "
              << spec.batch << ")\n";
    const Data data = makeData(spec);
    std::optional<double> single_ms;
    auto speedup = [&](Row row) {
      if (single_ms && row.ms_per_step > 0) row.speedup_vs_single = *single_ms / row.ms_per_step;
      return row;
    };
    if (cfg.modes.count("single")) {
      Row row = runSingle(spec, data, cfg);
      single_ms = row.ms_per_step;
      row.speedup_vs_single = 1.0;
      record(row);
    }
    if (cfg.modes.count("shm")) record(speedup(runShm(spec, data, cfg)));
    if (cfg.modes.count("gloo")) record(speedup(runGloo(spec, data, cfg, cfg.warmup, cfg.steps)));
    if (cfg.modes.count("shm-1node")) {
      // One node with shm-2nodes' workers per node, at the same per-worker batch.
      Config one = cfg;
      one.workers = std::max(1, cfg.workers / 2);
      ModelSpec half = spec;
      half.batch = std::max<std::int64_t>(1, spec.batch / 2);
      Row row = runShm(half, makeData(half), one);
      row.mode = "shm-1node";
      record(row);
    }
    if (cfg.modes.count("shm-2nodes"))
      record(speedup(runNodes(spec, data, cfg, gradagg::Compression::kNone, true)));
    if (cfg.modes.count("shm-2nodes-bf16"))
      record(speedup(runNodes(spec, data, cfg, gradagg::Compression::kBFloat16, true)));
    if (cfg.modes.count("shm-2nodes-after"))
      record(speedup(runNodes(spec, data, cfg, gradagg::Compression::kNone, false)));
    if (cfg.modes.count("reduce-only")) record(runReduceOnly(spec, cfg));
  }

  bool all_ok = true;
  if (cfg.check) {
    for (const char* name : {"807", "55k"}) {
      ModelSpec spec = parseModel(name);
      if (cfg.batch > 0) spec.batch = cfg.batch;
      Row row = runCheck(spec, makeData(spec), cfg);
      all_ok = all_ok && row.ok.value_or(false);
      record(row);
    }
  }

  std::cout << "\n";
  printTable(std::cout, rows);
  if (!all_ok) {
    std::cout << "FAILED: shm and gloo gradients differ by more than 1e-5 relative\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace gradagg::bench

int main(int argc, char** argv) {
  try {
    return gradagg::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "gradagg-bench: " << e.what() << "\n";
    return 2;
  }
}
