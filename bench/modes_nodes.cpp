// The shm-2nodes modes: two forked process trees (nodes) on this host, each an
// Aggregator with max(1, workers / 2) workers, joined through c10d Gloo over
// loopback or an emulated cluster's link (placement.h). A row sets the
// cross-node step (StepReport::node_ms) next to the in-node reduction and to one
// Gloo allreduce of the same P floats between two forked processes, measured in
// the same run. Each node sends and receives about P x 4 bytes per step (a ring
// allreduce of 2 nodes); the status rides in the same buffer (8 + parameter
// tensors floats).
#include <algorithm>
#include <string>
#include <vector>

#include "forked_peers.h"
#include "modes.h"
#include "runtime/temp_dir.h"

namespace gradagg::bench {

namespace {

constexpr auto kNodesTimeout = std::chrono::minutes(30);

struct NodeRun {
  const ModelSpec& spec;
  const Data& data;
  const Config& cfg;
  gradagg::Compression compression;
  bool overlap;
  int perNode() const { return std::max(1, cfg.workers / 2); }
  int totalSteps() const { return cfg.warmup + cfg.steps; }
};

struct NodeTimes {  // one node's step, written by the node's process
  double total_ms, node_ms, reduce_ms;
  std::uint64_t node_bytes;
  int collectives, overlapped;
};

gradagg::Options nodeOptions(const NodeRun& run, int node, const std::string& store_path,
                             const std::string& interface) {
  gradagg::Options options;
  options.workers = run.perNode();
  options.keep_worker_memory = run.cfg.keep_worker_memory;
  options.parent_threads = run.cfg.parent_threads;
  options.nodes.nodes = 2;
  options.nodes.node_rank = node;
  options.nodes.store_path = store_path;
  options.nodes.interface = interface;
  options.nodes.checksum_interval = 0;
  options.nodes.compression = run.compression;
  options.nodes.overlap = run.overlap;
  return options;
}

// Node `node`'s steps, in the forked child: times[s] for each step s.
void trainNode(const NodeRun& run, int node, const std::string& store_path, NodeTimes* times) {
  const ClusterMachine machine = enterMachine(run.cfg.placement, node);
  pinTo(run.cfg.placement, node, 2);
  Net model = makeModel(run.spec);
  auto opt = makeOptimizer(run.cfg.optimizer, model);
  gradagg::Aggregator agg(*model, shmShard(model, run.data, run.spec),
                          nodeOptions(run, node, store_path, machine.interface));
  for (int s = 0; s < run.totalSteps(); ++s) {
    const auto t0 = Clock::now();
    const gradagg::StepReport& r = agg.step();
    opt->step();
    times[s] = NodeTimes{msSince(t0),  r.node_ms,          r.reduce_ms,
                         r.node_bytes, r.node_collectives, r.node_overlapped};
  }
}

const char* modeName(const NodeRun& run) {
  if (run.compression == gradagg::Compression::kBFloat16) return "shm-2nodes-bf16";
  return run.overlap ? "shm-2nodes" : "shm-2nodes-after";
}

// The row from node 0's times (`times`) and node 1's (`times + totalSteps()`).
Row nodesRow(const NodeRun& run, const NodeTimes* times) {
  const int total_steps = run.totalSteps();
  std::vector<double> total, node_ms, reduce, last;
  double overlapped = 0;
  for (int s = run.cfg.warmup; s < total_steps; ++s) {
    const double of[2] = {times[s].node_ms, times[total_steps + s].node_ms};
    last.push_back(lastArrival(of, 2, 1));
    total.push_back(times[s].total_ms);
    node_ms.push_back(times[s].node_ms);
    reduce.push_back(times[s].reduce_ms);
    overlapped += times[s].overlapped;
  }
  Row row = makeRow(run.spec, modeName(run), 2 * run.perNode(), 1, run.cfg.steps);
  row.ms_per_step = median(total);
  row.p90_ms = percentile90(total);
  row.reduce_ms = median(reduce);
  row.sync_us = 1000 * median(node_ms);
  row.extra["node_ms"] = median(node_ms);
  // What this node put into the step's collectives (StepReport::node_bytes).
  row.extra["bytes_per_node_per_step"] = static_cast<double>(times[total_steps - 1].node_bytes);
  // The collectives of a step, and how many of them started during backward.
  row.extra["collectives"] = times[total_steps - 1].collectives;
  row.extra["overlapped_per_step"] = overlapped / std::max(1, run.cfg.steps);
  const double gloo =
      glooAllreduceMs(run.cfg.placement, 2, static_cast<std::size_t>(paramCount(run.spec)),
                      std::max(run.cfg.steps, 50), 1);
  row.extra["gloo_allreduce_ms"] = gloo;
  row.extra["node_over_gloo"] = median(node_ms) / gloo;
  row.extra["node_last_ms"] = median(last);
  row.extra["node_last_over_gloo"] = median(last) / gloo;
  return row;
}

Row runNodesWith(const NodeRun& run) {
  detail::TempDir dir("bench");
  detail::Segment shared;
  // Node 0's timings, then node 1's.
  auto* times =
      static_cast<NodeTimes*>(sharedMapping(shared, sizeof(NodeTimes) * 2 * run.totalSteps()));
  ForkedPeers nodes;
  nodes.spawn(2, [&](int node) {
    trainNode(run, node, dir.path() + "/store", times + node * run.totalSteps());
    return 0;
  });
  nodes.join(kNodesTimeout);
  return nodesRow(run, times);
}

}  // namespace

Row runNodes(const ModelSpec& spec, const Data& data, const Config& cfg) {
  return runNodesWith({spec, data, cfg, gradagg::Compression::kNone, true});
}

Row runNodesBf16(const ModelSpec& spec, const Data& data, const Config& cfg) {
  return runNodesWith({spec, data, cfg, gradagg::Compression::kBFloat16, true});
}

Row runNodesAfter(const ModelSpec& spec, const Data& data, const Config& cfg) {
  return runNodesWith({spec, data, cfg, gradagg::Compression::kNone, false});
}

}  // namespace gradagg::bench
