// Two nodes train as one: the same parameters as one node with all the workers,
// bitwise identical on both nodes; NodeOptions from torchrun-style variables.
#include <cstdlib>

#include "node_harness.h"

namespace gradagg_test {
namespace {

TEST_F(MultiNode, TwoNodesOfTwoWorkersMatchOneNodeOfFourAndAgreeBitwise) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("a");
  NodeRun other = run;
  other.node = 1;
  const auto results = runNodes({run, other});
  ASSERT_EQ(results[0].outcome, kOk) << results[0].what;
  ASSERT_EQ(results[1].outcome, kOk) << results[1].what;
  const auto reference = trainOneNode(4, run);
  // Float64: the two sums differ in order only; 1e-12 relative.
  expectClose(results[0].params, reference, 1e-12, "node 0 vs one node of 4");
  for (size_t k = 0; k < reference.size(); ++k)
    EXPECT_TRUE(torch::equal(results[0].params[k], results[1].params[k])) << "tensor " << k;
}

TEST_F(MultiNode, UnequalWorkerCountsStillGiveTheGlobalSampleWeightedMean) {
  NodeRun run;
  run.nodes = 2;
  run.kind = ModelKind::kConvBnEval;
  run.unequal = true;
  run.batch = 18;
  run.store = store("b");
  NodeRun other = run;
  other.node = 1;
  other.workers = 1;
  const auto results = runNodes({run, other});
  ASSERT_EQ(results[0].outcome, kOk) << results[0].what;
  ASSERT_EQ(results[1].outcome, kOk) << results[1].what;
  // Independent: one process, full batch, plain autograd and SGD.
  auto model = makeModel(run.kind, torch::kDouble);
  const Data data = makeData(run.kind, run.batch, torch::kDouble);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.5));
  for (int s = 0; s < run.steps; ++s) {
    sgd.zero_grad();
    model->loss(model->forward(data.x), data.y).backward();
    sgd.step();
  }
  std::vector<torch::Tensor> want;
  for (auto& p : model->parameters()) want.push_back(p.detach());
  expectClose(results[0].params, want, 1e-10, "2 + 1 workers vs one process");
  for (size_t k = 0; k < want.size(); ++k)
    EXPECT_TRUE(torch::equal(results[0].params[k], results[1].params[k])) << "tensor " << k;
}

TEST(NodeOptions, FromEnvironmentReadsTorchrunStyleVariables) {
  ::setenv("GRADAGG_NNODES", "3", 1);
  ::setenv("GRADAGG_NODE_RANK", "2", 1);
  ::setenv("MASTER_ADDR", "10.1.2.3", 1);
  ::setenv("MASTER_PORT", "29999", 1);
  const auto o = gradagg::NodeOptions::fromEnvironment();
  EXPECT_EQ(o.nodes, 3);
  EXPECT_EQ(o.node_rank, 2);
  EXPECT_EQ(o.master_addr, "10.1.2.3");
  EXPECT_EQ(o.master_port, 29999);
  ::setenv("GRADAGG_NODE_RANK", "two", 1);
  EXPECT_THROW(gradagg::NodeOptions::fromEnvironment(), gradagg::InvalidArgument);
  for (const char* v : {"GRADAGG_NNODES", "GRADAGG_NODE_RANK", "MASTER_ADDR", "MASTER_PORT"})
    ::unsetenv(v);
}

}  // namespace
}  // namespace gradagg_test
