// The multinode tests' harness: several nodes on loopback, each a process tree (an
// Aggregator's parent and its workers) that joins the others through c10d Gloo,
// with a FileStore rendezvous in the test's own TempDir. Each node process sends
// back through a pipe what happened and its parameters.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "runtime/temp_dir.h"
#include "support/support.h"

namespace gradagg_test {

struct NodeRun {
  int node = 0;
  int nodes = 1;
  int workers = 2;
  ModelKind kind = ModelKind::kMlp;
  torch::Dtype dtype = torch::kDouble;
  gradagg::Compression compression = gradagg::Compression::kNone;
  int64_t batch = 24;
  int steps = 4;
  bool unequal = false;
  std::string store;
  std::chrono::milliseconds start_delay{0};  // this node starts that much later
  int master_port = 0;  // > 0: a TCPStore on 127.0.0.1 at this port instead of the FileStore
  bool external_store = false;           // NodeOptions::external_store
  std::string store_prefix = "gradagg";  // NodeOptions::store_prefix
  std::chrono::milliseconds timeout{20000};
  std::string token;                      // NodeOptions::token
  std::string master_addr = "127.0.0.1";  // NodeOptions::master_addr
  // gradagg::interruptWaits() this long after the Aggregator's construction
  // begins (interrupt_at_step < 0) or after step interrupt_at_step begins.
  int interrupt_after_ms = -1;
  int interrupt_at_step = -1;
  int interrupt_patience_ms = 0;  // > 0: interruptWaits(patience)
  // NodeOptions' start-up agreement.
  std::int64_t start_step = 0;
  std::string resume_identity;
  std::map<std::string, std::string> must_match;
  int kill_self_at_step = -1;   // this node's parent dies (SIGKILL) during that step
  int perturb_after_step = -1;  // this node's parameters drift after that step
  int stop_self_at_step = -1;   // this node's parent stops (SIGSTOP) during that step: a stall
  int stop_self_after_ms = -1;  // ... that long after its Aggregator's construction begins
  int kill_self_after_ms = -1;  // this node's parent dies (SIGKILL) that long after it begins
  // This node's child processes (its workers, node 0's store server) stop
  // (SIGSTOP) that long after it begins: with kill_self_after_ms, a machine
  // that stalls and then dies.
  int stop_children_after_ms = -1;
  int throw_at_step = -1;     // this node's worker 0 throws from the shard function then
  int nan_loss_at_step = -1;  // this node's worker 0 returns a NaN loss then
  // Buckets and overlap (NodeOptions), gradient accumulation (Options).
  std::uint64_t bucket_bytes = 25ull << 20;
  bool overlap = true;
  int accumulation_steps = 1;
  // This node's worker 1 dies (SIGKILL) in that step's backward, once the
  // gradient of the model's first parameter (the last bucket's) is computed.
  int kill_worker_in_backward_at_step = -1;
  // This node's worker 1 dies (SIGKILL) in its shard function in that step, once
  // per node: the worker that redoes the step lives.
  int kill_worker_once_at_step = -1;
  int max_restarts = 0;     // Options::max_restarts
  bool drop_grads = false;  // the shard function sets every .grad to undefined first
  // The loss gets a term whose backward runs a backward of its own over the
  // last parameter (as torch.utils.checkpoint with use_reentrant=True does):
  // that parameter's gradient is accumulated twice in one backward.
  bool reentrant_last_param = false;
  int slow_first_layer_ms = 0;  // backward sleeps this long before the first parameter's gradient
  // Each step the parent sends {"node": node} as the message, and the shard
  // function returns the metrics rows, step and seen_node (the message's node).
  bool metrics_and_message = false;
  int metric_names = 0;  // > 0: the shard function returns this many metrics, "m0", "m1", ... = 1
  // Workers of this global rank and above have 0 samples every step; the batch
  // is shared by the others.
  int empty_from_global_rank = -1;
  int all_empty_at_step = -1;  // every worker of this node has 0 samples then
  int checksum_interval = 2;   // NodeOptions::checksum_interval
  int pause_before_step = -1;  // this node's parent sleeps `pause` before calling that step
  std::chrono::milliseconds pause{0};
  gradagg::Weighting weighting = gradagg::Weighting::kBySamples;
};

// How a call ended: normally, or with which error.
enum Outcome : int {
  kOk = 0,
  kNodeFailed = 1,
  kInvalidArgument = 2,
  kOther = 3,
  kNotUsable = 4,
  kWorkerFailed = 5,
  kWorkerDied = 6,
  kInterrupted = 7
};
void PrintTo(Outcome outcome, std::ostream* os);  // for GoogleTest's messages

// What a node sends back.
struct NodeResult {
  Outcome outcome = kOther;  // how the steps ended
  std::string what;          // the error's message
  std::vector<torch::Tensor> params;
  double seconds = 0;
  int status = 0;                // the node process's wait status (waitpid)
  std::int64_t max_rss_mib = 0;  // the node process's peak resident memory
  std::uint64_t node_bytes = 0;  // StepReport::node_bytes of the last step
  int collectives = 0;           // StepReport::node_collectives of the last step
  int overlapped = 0;            // StepReport::node_overlapped, summed over the steps
  int restarts = 0;              // StepReport::restarts of the last step
  // After a NodeFailed: what the node's aggregator was left as (include/gradagg/errors.h
  // says: workers stopped, no longer usable), and how one more step() ended.
  bool usable_after = false;
  int children_after = -1;  // the node's child processes (its workers) still there
  Outcome retry = kOther;
  std::string retry_what;
  // The last step's StepReport::metrics and its workers[0].metrics.
  std::map<std::string, double> metrics, worker0_metrics;
};

// Trains on this node: worker r takes the global shard of global rank offset + r.
NodeResult trainNode(const NodeRun& run);

// Starts one process per node, collects what each sends back through a pipe.
std::vector<NodeResult> runNodes(std::vector<NodeRun> runs);

// The same training on one node of `workers` workers, in this process.
std::vector<torch::Tensor> trainOneNode(int workers, const NodeRun& like);

class MultiNode : public GradaggTest {
 protected:
  // A FileStore path for one group of nodes, in a directory of this test's own.
  std::string store(const std::string& name) const { return dir_.file(name); }
  // A TCP port free on loopback now.
  static int freePort();
  gradagg::detail::TempDir dir_{"nodes"};
};

}  // namespace gradagg_test
