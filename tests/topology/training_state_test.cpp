// Training state across nodes: each node's parent sends its own message to its
// own workers, metrics are summed over every node's workers, the global step
// starts at Options::start_step on every node, and nodes whose workers have
// nothing to do leave the mean over the samples that exist.
#include "node_harness.h"

namespace gradagg_test {
namespace {

// The same training in one process: plain autograd and SGD on the whole batch.
std::vector<torch::Tensor> oneProcess(const NodeRun& run) {
  auto model = makeModel(run.kind, run.dtype);
  const Data data = makeData(run.kind, run.batch, run.dtype);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.5));
  for (int s = 0; s < run.steps; ++s) {
    sgd.zero_grad();
    model->loss(model->forward(data.x), data.y).backward();
    sgd.step();
  }
  return paramsOf(*model);
}

TEST_F(MultiNode, MessagesStayOnTheirNodeMetricsSumOverAllAndTheStepStartsAtStartStep) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("m");
  run.metrics_and_message = true;
  run.start_step = 7;
  NodeRun other = run;
  other.node = 1;
  const auto results = runNodes({run, other});
  for (int n = 0; n < 2; ++n) {
    ASSERT_EQ(results[n].outcome, kOk) << results[n].what;
    const auto& m = results[n].metrics;
    ASSERT_EQ(m.size(), 3u) << "node " << n;
    EXPECT_EQ(m.at("rows"), run.batch);
    EXPECT_EQ(m.at("step"), 4 * (run.start_step + run.steps - 1)) << "ctx.step on 4 workers";
    EXPECT_EQ(m.at("seen_node"), 0 + 0 + 1 + 1) << "node 0's workers saw 0, node 1's saw 1";
    EXPECT_EQ(results[n].worker0_metrics.at("seen_node"), n);
  }
  expectClose(results[0].params, oneProcess(run), 1e-10, "node 0 vs one process");
}

TEST_F(MultiNode, ANodeWhoseWorkersHaveNothingLeavesTheMeanOverTheSamplesThatExist) {
  NodeRun run;
  run.nodes = 2;
  run.batch = 10;
  run.store = store("e");
  run.metrics_and_message = true;
  run.empty_from_global_rank = 2;  // node 1's two workers have no rows
  NodeRun other = run;
  other.node = 1;
  const auto results = runNodes({run, other});
  for (int n = 0; n < 2; ++n) ASSERT_EQ(results[n].outcome, kOk) << results[n].what;
  EXPECT_EQ(results[0].metrics.at("rows"), run.batch);
  // Node 1's workers never had a sample: it never learnt the metrics' names.
  EXPECT_TRUE(results[1].metrics.empty());
  expectClose(results[0].params, oneProcess(run), 1e-10, "node 0 vs one process");
  for (size_t k = 0; k < results[0].params.size(); ++k)
    EXPECT_TRUE(torch::equal(results[0].params[k], results[1].params[k])) << "tensor " << k;
}

// Nodes whose shard functions return different numbers of metrics (1, 3 and
// 2 names: the third has the mean count) all refuse the step at once, not two
// of them while the third waits alone in the metric collective until its timeout.
TEST_F(MultiNode, NodesWithDifferentMetricsAllRefuseTheStepAtOnce) {
  std::vector<NodeRun> runs;
  for (const int names : {1, 3, 2}) {
    NodeRun run;
    run.node = static_cast<int>(runs.size());
    run.nodes = 3;
    run.workers = 1;
    run.steps = 2;
    run.store = store("metrics");
    run.timeout = std::chrono::milliseconds(8000);
    run.metric_names = names;
    runs.push_back(run);
  }
  const auto results = runNodes(runs);
  for (int n = 0; n < 3; ++n) {
    EXPECT_EQ(results[n].outcome, kInvalidArgument) << "node " << n << ": " << results[n].what;
    EXPECT_NE(results[n].what.find("return different metrics"), std::string::npos)
        << results[n].what;
    EXPECT_LT(results[n].seconds, 6.0) << "node " << n << " waited for its timeout";
  }
}

// Embedding(sparse=true) across nodes: every node's parent gets the sparse
// .grad of the rows touched anywhere (the rows cross in a collective of their
// own), also a node whose workers had nothing, and SGD trains as one process.
TEST_F(MultiNode, SparseGradientsStaySparseAcrossNodesOverTheRowsTouchedAnywhere) {
  for (const int empty_from : {-1, 2}) {
    NodeRun run;
    run.nodes = 2;
    run.kind = ModelKind::kSparseEmbedding;
    run.store = store(empty_from < 0 ? "s" : "s-empty");
    run.empty_from_global_rank = empty_from;  // 2: node 1's workers have no rows
    NodeRun other = run;
    other.node = 1;
    const auto results = runNodes({run, other});
    for (int n = 0; n < 2; ++n) {
      ASSERT_EQ(results[n].outcome, kOk) << results[n].what;
      EXPECT_EQ(
          results[n].metrics.count("sparse_grads") ? results[n].metrics.at("sparse_grads") : 0, 1)
          << "node " << n << ", empty from " << empty_from;
    }
    expectClose(results[0].params, oneProcess(run), 1e-10, "node 0 vs one process");
    for (size_t k = 0; k < results[0].params.size(); ++k)
      EXPECT_TRUE(torch::equal(results[0].params[k], results[1].params[k])) << "tensor " << k;
  }
}

TEST_F(MultiNode, AStepWithNoSamplesOnAnyNodeIsAnInvalidArgumentOnEvery) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("z");
  run.all_empty_at_step = 2;
  NodeRun other = run;
  other.node = 1;
  const auto results = runNodes({run, other});
  for (int n = 0; n < 2; ++n) {
    EXPECT_EQ(results[n].outcome, kInvalidArgument) << results[n].what;
    EXPECT_NE(results[n].what.find("0 samples"), std::string::npos) << results[n].what;
  }
}

}  // namespace
}  // namespace gradagg_test
