// The multinode tests' harness: several nodes on loopback, each a process tree (an
// Aggregator's parent and its workers) that joins the others through c10d Gloo,
// with a FileStore rendezvous in the test's own TempDir. Each node process sends
// back through a pipe what happened and its parameters.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/temp_dir.h"
#include "support/support.h"

namespace gradagg_test {

struct NodeRun {
  int node = 0;
  int nodes = 1;
  int workers = 2;
  ModelKind kind = ModelKind::kMlp;
  int64_t batch = 24;
  int steps = 4;
  bool unequal = false;
  std::string store;
  std::chrono::milliseconds timeout{20000};
  int kill_self_at_step = -1;  // this node's parent dies (SIGKILL) during that step
  int perturb_after_step = -1;  // this node's parameters drift after that step
  int stop_self_at_step = -1;   // this node's parent stops (SIGSTOP) during that step: a stall
};

// What a node process sends back: an outcome code and its parameters.
enum Outcome : int { kOk = 0, kNodeFailed = 1, kInvalidArgument = 2, kOther = 3 };

// Trains on this node: worker r takes the global shard of global rank offset + r.
std::vector<torch::Tensor> trainNode(const NodeRun& run, Outcome* outcome, std::string* what);

struct NodeResult {
  Outcome outcome = kOther;
  std::string what;
  std::vector<torch::Tensor> params;
  double seconds = 0;
};

// Starts one process per node, collects what each sends back through a pipe.
std::vector<NodeResult> runNodes(std::vector<NodeRun> runs);

// The same training on one node of `workers` workers, in this process.
std::vector<torch::Tensor> trainOneNode(int workers, const NodeRun& like);

class MultiNode : public GradaggTest {
 protected:
  // A FileStore path for one group of nodes, in a directory of this test's own.
  std::string store(const std::string& name) const { return dir_.file(name); }
  gradagg::detail::TempDir dir_{"nodes"};
};

}  // namespace gradagg_test
