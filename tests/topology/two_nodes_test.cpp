// Two nodes train as one: the same parameters as one node with all the workers,
// bitwise identical on both nodes; NodeOptions from torchrun-style variables.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

#include "node_harness.h"
#include "support/expect_throws.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

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

// The variables are process-wide: each test sets what it needs and removes them all.
struct Environment {
  explicit Environment(std::initializer_list<std::pair<const char*, const char*>> vars)
      : vars_(vars) {
    for (const auto& [name, value] : vars_) ::setenv(name, value, 1);
  }
  ~Environment() {
    for (const auto& [name, value] : vars_) ::unsetenv(name);
  }
  std::vector<std::pair<const char*, const char*>> vars_;
};

// What torchrun 1.13 gives each process (local_elastic_agent.py), with
// --nnodes 3 --nproc-per-node 1 and its default static rendezvous.
TEST(NodeOptions, FromEnvironmentReadsTorchrunsVariables) {
  Environment env({{"GROUP_WORLD_SIZE", "3"},
                   {"GROUP_RANK", "1"},
                   {"WORLD_SIZE", "3"},
                   {"LOCAL_WORLD_SIZE", "1"},
                   {"RANK", "1"},
                   {"LOCAL_RANK", "0"},
                   {"MASTER_ADDR", "10.1.2.3"},
                   {"MASTER_PORT", "29400"},
                   {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                   {"TORCHELASTIC_RESTART_COUNT", "2"}});
  const auto o = gradagg::NodeOptions::fromEnvironment();
  EXPECT_EQ(o.nodes, 3);
  EXPECT_EQ(o.node_rank, 1);
  EXPECT_EQ(o.master_addr, "10.1.2.3");
  EXPECT_EQ(o.master_port, 29400);
  EXPECT_TRUE(o.external_store);
  EXPECT_EQ(o.store_prefix, "gradagg/attempt_2");
  Environment explicit_ones({{"GRADAGG_NNODES", "2"}, {"GRADAGG_NODE_RANK", "0"}});
  const auto e = gradagg::NodeOptions::fromEnvironment();
  EXPECT_EQ(e.nodes, 2) << "GRADAGG_NNODES takes precedence";
  EXPECT_EQ(e.node_rank, 0) << "GRADAGG_NODE_RANK takes precedence";
}

// init_process_group's env:// variables alone: one node per process, never a
// node that trains alone while its peers wait; several processes per node refused.
TEST(NodeOptions, FromEnvironmentReadsTheEnvConventionAndRefusesProcessesPerNode) {
  {
    Environment env({{"WORLD_SIZE", "2"},
                     {"RANK", "1"},
                     {"MASTER_ADDR", "10.1.2.3"},
                     {"MASTER_PORT", "29500"}});
    const auto o = gradagg::NodeOptions::fromEnvironment();
    EXPECT_EQ(o.nodes, 2);
    EXPECT_EQ(o.node_rank, 1);
    EXPECT_EQ(o.master_addr, "10.1.2.3");
  }
  Environment per_node({{"GROUP_WORLD_SIZE", "2"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}});
  if (const auto e = expectThrows<gradagg::InvalidArgument>(
          [] { gradagg::NodeOptions::fromEnvironment(); }, "LOCAL_WORLD_SIZE=2")) {
    EXPECT_NE(std::string(e->what()).find("--nproc_per_node 1"), std::string::npos) << e->what();
  }
}

TEST(NodeOptions, FromEnvironmentReadsSlurmsVariables) {
  Environment env(
      {{"SLURM_NNODES", "4"}, {"SLURM_NODEID", "3"}, {"SLURM_JOB_NODELIST", "gpu[07-10,12],cpu1"}});
  auto o = gradagg::NodeOptions::fromEnvironment();
  EXPECT_EQ(o.nodes, 4);
  EXPECT_EQ(o.node_rank, 3);
  EXPECT_EQ(o.master_addr, "gpu07");
  EXPECT_FALSE(o.external_store);
  for (const auto& [list, first] : std::vector<std::pair<const char*, const char*>>{
           {"n1,n2", "n1"}, {"solo", "solo"}, {"r[2-3]x,r9", "r2x"}, {"a[5]", "a5"}}) {
    Environment nodes({{"SLURM_JOB_NODELIST", list}});
    EXPECT_EQ(gradagg::NodeOptions::fromEnvironment().master_addr, first) << list;
  }
  Environment master({{"MASTER_ADDR", "10.0.0.9"}, {"GRADAGG_NODE_RANK", "1"}});
  o = gradagg::NodeOptions::fromEnvironment();
  EXPECT_EQ(o.master_addr, "10.0.0.9") << "MASTER_ADDR takes precedence";
  EXPECT_EQ(o.node_rank, 1);
  Environment bad({{"SLURM_NODEID", "third"}});
  EXPECT_THROW(gradagg::NodeOptions::fromEnvironment(), gradagg::InvalidArgument);
}

// A host list with several brackets names its first host whole; inside a step
// (srun) the step's own node list and node count, which SLURM_NODEID counts, win
// over the job's.
TEST(NodeOptions, FromEnvironmentTakesNode0FromTheStepsNodeListWithEveryBracketExpanded) {
  for (const auto& [list, first] :
       std::vector<std::pair<const char*, const char*>>{{"rack[1-2]-n[01-04]", "rack1-n01"},
                                                        {"rack[3,5]-n[07-08],solo", "rack3-n07"},
                                                        {"a[2-3]b[4]c", "a2b4c"}}) {
    Environment nodes({{"SLURM_JOB_NODELIST", list}});
    EXPECT_EQ(gradagg::NodeOptions::fromEnvironment().master_addr, first) << list;
  }
  // A job on gpu[01-08] whose step runs on its last four nodes: node 0 of the step is gpu05.
  Environment step({{"SLURM_JOB_NODELIST", "gpu[01-08]"},
                    {"SLURM_NNODES", "4"},
                    {"SLURM_STEP_NODELIST", "gpu[05-08]"},
                    {"SLURM_STEP_NUM_NODES", "4"},
                    {"SLURM_NODEID", "2"}});
  const auto o = gradagg::NodeOptions::fromEnvironment();
  EXPECT_EQ(o.master_addr, "gpu05");
  EXPECT_EQ(o.nodes, 4);
  EXPECT_EQ(o.node_rank, 2);
}

// srun with several tasks per node would start several node parents on one
// machine, each forking all its workers: refused, as torchrun's LOCAL_WORLD_SIZE > 1.
TEST(NodeOptions, FromEnvironmentRefusesSeveralSlurmTasksPerNode) {
  Environment nodes({{"SLURM_NNODES", "2"}, {"SLURM_NODEID", "0"}, {"SLURM_NTASKS", "2"}});
  EXPECT_EQ(gradagg::NodeOptions::fromEnvironment().nodes, 2) << "one task per node";
  const auto refused = [](const char* what) {
    if (const auto e = expectThrows<gradagg::InvalidArgument>(
            [] { gradagg::NodeOptions::fromEnvironment(); }, what)) {
      EXPECT_NE(std::string(e->what()).find("--ntasks-per-node 1"), std::string::npos) << e->what();
    }
  };
  {
    Environment per_node({{"SLURM_NTASKS_PER_NODE", "4"}});
    refused("SLURM_NTASKS_PER_NODE=4");
  }
  {
    Environment step({{"SLURM_STEP_TASKS_PER_NODE", "1(x2),2"}});
    refused("SLURM_STEP_TASKS_PER_NODE=1(x2),2");
  }
  {
    // The step's one task per node, in a job of four per node: the step's layout counts.
    Environment step({{"SLURM_STEP_TASKS_PER_NODE", "1(x2)"}, {"SLURM_NTASKS_PER_NODE", "4"}});
    EXPECT_NO_THROW(gradagg::NodeOptions::fromEnvironment());
  }
  Environment tasks({{"SLURM_NTASKS", "8"}});
  refused("SLURM_NTASKS=8 and SLURM_NNODES=2");
}

// torchrun's static rendezvous: its agent on node 0 serves the TCPStore and every
// node (node 0 too) connects to it as a client, under a per-attempt prefix. The
// agent is a process of its own, as torchrun's is: a store server's thread in
// this process could hold a lock of the allocator when the nodes are forked.
TEST_F(MultiNode, NodesMeetInALaunchersStore) {
  int port_pipe[2], done_pipe[2];
  ASSERT_EQ(::pipe(port_pipe), 0);
  ASSERT_EQ(::pipe(done_pipe), 0);
  const pid_t agent = ::fork();
  if (agent == 0) {
    ::close(port_pipe[0]);
    ::close(done_pipe[1]);
    c10d::TCPStoreOptions server;
    server.port = 0;  // any free port
    server.isServer = true;
    server.waitWorkers = false;
    auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", server);
    const int port = store->getPort();
    (void)!::write(port_pipe[1], &port, sizeof port);
    char done = 0;
    (void)!::read(done_pipe[0], &done, 1);  // until the nodes are done
    ::_exit(store->check({"gradagg/attempt_0/join/1"}) ? 0 : 1);
  }
  ::close(port_pipe[1]);
  ::close(done_pipe[0]);
  int port = 0;
  ASSERT_EQ(::read(port_pipe[0], &port, sizeof port), static_cast<ssize_t>(sizeof port));
  NodeRun run;
  run.nodes = 2;
  run.master_port = port;
  run.external_store = true;
  run.store_prefix = "gradagg/attempt_0";
  NodeRun other = run;
  other.node = 1;
  const auto results = runNodes({run, other});
  ::close(done_pipe[1]);  // the agent reads end of file
  ::close(port_pipe[0]);
  int status = 0;
  ::waitpid(agent, &status, 0);
  for (const auto& r : results) EXPECT_EQ(r.outcome, kOk) << r.what;
  EXPECT_TRUE(bitIdentical(results[0].params, results[1].params));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the nodes did not use the agent's store (status " << status << ")";
}

}  // namespace
}  // namespace gradagg_test
