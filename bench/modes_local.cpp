// The modes on one machine without a network: `single`, one process with
// --threads intra-op threads (zero_grad, forward, backward, optimizer step), and
// `shm`, gradagg::Aggregator with --workers forked workers, then the parent's
// optimizer.step(); `shm-1node` is shm at shm-2nodes' size per node.
#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "modes.h"

namespace gradagg::bench {

namespace {

// The medians a shm row reports, gathered step by step.
struct ShmSamples {
  std::vector<double> total, optimizer, reduce, sync, slot, compute, publish, worker;
  // The per-phase breakdown of a step (worker 0's phases; the parent's apply).
  std::map<std::string, std::vector<double>> phases;

  void add(const gradagg::StepReport& r, double total_ms, double optimizer_ms);
  void fill(Row& row) const;
};

void ShmSamples::add(const gradagg::StepReport& r, double total_ms, double optimizer_ms) {
  total.push_back(total_ms);
  optimizer.push_back(optimizer_ms);
  // Work: the slowest worker's own phases (snapshot load and slot zeroing,
  // shard function, backward, slot checks, its range of the reduction).
  // Synchronisation: the rest of step() (wake-ups, barrier waits, publish, apply).
  double slowest = 0, busiest = 0, slot_ms = 0;
  for (const gradagg::WorkerReport& w : r.workers) {
    slowest = std::max(slowest, w.shard_ms + w.backward_ms);
    busiest = std::max(busiest, w.load_ms + w.shard_ms + w.backward_ms + w.write_ms + w.reduce_ms);
    slot_ms = std::max(slot_ms, w.load_ms + w.write_ms);
  }
  reduce.push_back(r.reduce_ms);
  sync.push_back(1000 * (r.total_ms - busiest));
  slot.push_back(slot_ms);
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

void ShmSamples::fill(Row& row) const {
  row.ms_per_step = median(total);
  row.p90_ms = percentile90(total);
  row.reduce_ms = median(reduce);
  row.sync_us = median(sync);
  row.extra["compute_ms"] = median(compute);
  row.extra["worker_ms"] = median(worker);
  row.extra["slot_ms"] = median(slot);
  row.extra["publish_ms"] = median(publish);
  row.extra["optimizer_ms"] = median(optimizer);
  for (const auto& [name, values] : phases) row.extra[name] = median(values);
}

}  // namespace

AloneTimes trainAlone(const ModelSpec& spec, const torch::Tensor& x, const torch::Tensor& y,
                      const Config& cfg, const std::function<void()>& before_first_step) {
  Net model = makeModel(spec);
  auto opt = makeOptimizer(cfg.optimizer, model);
  if (before_first_step) before_first_step();
  AloneTimes times;
  WarmUp warm(cfg.warmup);
  for (int s = 0; static_cast<int>(times.total.size()) < cfg.steps; ++s) {
    const auto t0 = Clock::now();
    const bool warming = warm.includes(s, t0);
    opt->zero_grad();
    loss(model, x, y).backward();
    const double c = msSince(t0);
    opt->step();
    if (warming) continue;
    times.total.push_back(msSince(t0));
    times.compute.push_back(c);
  }
  times.warmup_steps = warm.taken();
  return times;
}

Row runSingle(const ModelSpec& spec, const Data& data, const Config& cfg) {
  at::set_num_threads(cfg.threads);
  const AloneTimes times = trainAlone(spec, data.x, data.y, cfg);
  Row row = makeRow(spec, "single", 1, cfg.threads, cfg.steps);
  row.ms_per_step = median(times.total);
  row.p90_ms = percentile90(times.total);
  row.extra["compute_ms"] = median(times.compute);
  row.extra["warmup_steps"] = times.warmup_steps;
  return row;
}

// Global worker g of G takes its share of the batch (on one node the global
// rank is the rank); accumulating, its micro-batch i of k is the i-th k-th of that share.
gradagg::ShardFn shmShard(Net& model, const Data& data, const ModelSpec& spec) {
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
  Net model = makeModel(spec);
  auto opt = makeOptimizer(cfg.optimizer, model);
  gradagg::Options options;
  options.workers = cfg.workers;
  options.accumulation_steps = cfg.accumulate;
  options.keep_worker_memory = cfg.keep_worker_memory;
  options.parent_threads = cfg.parent_threads;
  options.message_bytes = std::max<std::uint64_t>(options.message_bytes, cfg.message_bytes + 4096);
  gradagg::Aggregator agg(*model, shmShard(model, data, spec), options);
  gradagg::Message message;  // the parent's per-step data, copied into the segment each step
  if (cfg.message_bytes > 0) message.set("payload", torch::ones({cfg.message_bytes / 4}));
  ShmSamples samples;
  WarmUp warm(cfg.warmup);
  for (int s = 0; static_cast<int>(samples.total.size()) < cfg.steps; ++s) {
    const auto t0 = Clock::now();
    const bool warming = warm.includes(s, t0);
    const gradagg::StepReport& r = agg.step(message);
    const auto t1 = Clock::now();
    opt->step();
    if (warming) continue;
    const double total_ms = msSince(t0);
    samples.add(r, total_ms, msSince(t1));
  }
  Row row = makeRow(spec, "shm", cfg.workers, agg.options().resolvedThreadsPerWorker(), cfg.steps);
  samples.fill(row);
  row.extra["warmup_steps"] = warm.taken();
  if (cfg.accumulate > 1) row.mode += "-acc" + std::to_string(cfg.accumulate);  // shm-acc4
  if (cfg.message_bytes > 0) row.mode += "-msg" + std::to_string(cfg.message_bytes);
  return row;
}

Row runShmOneNode(const ModelSpec& spec, const Data&, const Config& cfg) {
  Config one = cfg;
  one.workers = std::max(1, cfg.workers / 2);
  ModelSpec half = spec;
  half.batch = std::max<std::int64_t>(1, spec.batch / 2);
  Row row = runShm(half, makeData(half), one);
  row.mode = "shm-1node";
  return row;
}

}  // namespace gradagg::bench
