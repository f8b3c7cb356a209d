// A node that fails ends the step on every node with a named error: a killed or
// stalled node (within the timeout), diverged parameters, different models, a
// worker that fails on another node; and what a NodeFailed leaves behind.
#include <sys/wait.h>

#include <csignal>

#include "node_harness.h"

namespace gradagg_test {
namespace {

using namespace std::chrono_literals;

TEST_F(MultiNode, AKilledNodeEndsTheOtherWithNodeFailedWithinTheTimeout) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("c");
  run.timeout = 5000ms;
  run.steps = 6;
  NodeRun other = run;
  other.node = 1;
  other.kill_self_at_step = 2;
  const auto results = runNodes({run, other});
  EXPECT_EQ(results[0].outcome, kNodeFailed) << results[0].what;
  EXPECT_NE(results[0].what.find("node 0 of 2"), std::string::npos) << results[0].what;
  EXPECT_LT(results[0].seconds, 5.0 + 10.0);  // the timeout, plus start-up
}

TEST_F(MultiNode, AStalledNodeEndsTheOtherWithNodeFailedAfterTheTimeout) {
  ownProcessGroup();  // nothing but the harness continues the stopped node
  NodeRun run;
  run.nodes = 2;
  run.store = store("f");
  run.timeout = 2000ms;
  run.steps = 6;
  NodeRun other = run;
  other.node = 1;
  other.stop_self_at_step = 2;
  const auto results = runNodes({run, other});
  EXPECT_EQ(results[0].outcome, kNodeFailed) << results[0].what;
  EXPECT_GE(results[0].seconds, 2.0);         // it waited for the deadline...
  EXPECT_LT(results[0].seconds, 2.0 + 15.0);  // ...and not much longer
}

// Node 0's store server goes away while node 1 is connected to it and waits
// in the rendezvous: node 0 dies in its start-up (three nodes expected, the
// third never comes) and its server with it; or node 0's machine stalls (its
// server stops with node 1's requests unread) and then dies. c10d 1.13's
// TCPStore client aborted node 1 from its background thread in the second
// case ("terminate called ... Connection reset by peer", SIGABRT, issue 47);
// gradagg's client (store_client.h) fails the call that finds the server
// gone: NodeFailed, at once, and node 1 exits cleanly.
TEST_F(MultiNode, AStoreServerThatVanishesMidRendezvousIsNodeFailedNeverAnAbort) {
  for (const bool stalls_first : {false, true}) {
    SCOPED_TRACE(stalls_first ? "node 0 stalls, then dies" : "node 0 dies");
    NodeRun run;
    run.nodes = 3;
    run.master_port = freePort();
    run.timeout = 8s;
    run.kill_self_after_ms = 2000;
    if (stalls_first) run.stop_children_after_ms = 500;
    NodeRun other = run;
    other.node = 1;
    other.kill_self_after_ms = other.stop_children_after_ms = -1;
    other.start_delay = 1s;  // when node 0's server has stalled
    const auto results = runNodes({run, other});
    EXPECT_TRUE(WIFSIGNALED(results[0].status) && WTERMSIG(results[0].status) == SIGKILL)
        << "node 0 was to die in its start-up";
    EXPECT_TRUE(WIFEXITED(results[1].status) && WEXITSTATUS(results[1].status) == 0)
        << "node 1's wait status " << results[1].status << ", signal "
        << (WIFSIGNALED(results[1].status) ? WTERMSIG(results[1].status) : 0);
    EXPECT_EQ(results[1].outcome, kNodeFailed) << results[1].what;
    EXPECT_NE(results[1].what.find("rendezvous"), std::string::npos) << results[1].what;
    EXPECT_NE(results[1].what.find("went away"), std::string::npos) << results[1].what;
    // At once, not at its deadline: node 0 dies 1 s after node 1 starts.
    EXPECT_LT(results[1].seconds, 1.0 + 3.0) << results[1].what;
  }
}

TEST_F(MultiNode, DivergedParametersAreCaughtByTheChecksumOnEveryNode) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("e");
  run.steps = 6;  // checksums before steps 2 and 4
  NodeRun other = run;
  other.node = 1;
  other.perturb_after_step = 2;
  const auto results = runNodes({run, other});
  for (const auto& r : results) {
    EXPECT_EQ(r.outcome, kNodeFailed) << r.what;
    EXPECT_NE(r.what.find("diverged"), std::string::npos) << r.what;
    EXPECT_NE(r.what.find("node(s) 1"), std::string::npos) << r.what;
  }
}

// Options::max_restarts across nodes: a node whose worker died redoes the step
// with fresh workers while the other waits in the step's collectives; both then
// go on in step with each other (the same collectives in the same order, the
// parameter checksum before a checksum step included) and end where an
// unfaulted run ends. Killed in step 1 or 2, with the checksum before every
// step, every second one (the harness's interval) or off.
struct RestartCase {
  int kill_at_step;
  int checksum_interval;
};
void PrintTo(const RestartCase& c, std::ostream* os) {
  *os << "killed in step " << c.kill_at_step << ", checksum every " << c.checksum_interval;
}

class NodeRestart : public MultiNode, public ::testing::WithParamInterface<RestartCase> {};

TEST_P(NodeRestart, ANodeThatRestartsItsWorkersGoesOnWithTheOthersAndMatchesAnUnfaultedRun) {
  NodeRun run;
  run.nodes = 2;
  run.timeout = 10000ms;
  run.steps = 4;
  run.max_restarts = 1;
  run.checksum_interval = GetParam().checksum_interval;
  run.store = store("clean");
  NodeRun other = run;
  other.node = 1;
  const auto clean = runNodes({run, other});
  run.store = other.store = store("restarted");
  other.kill_worker_once_at_step = GetParam().kill_at_step;
  const auto restarted = runNodes({run, other});
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(clean[i].outcome, kOk) << clean[i].what;
    ASSERT_EQ(restarted[i].outcome, kOk) << "node " << i << ": " << restarted[i].what;
    EXPECT_TRUE(bitIdentical(restarted[i].params, clean[i].params)) << "node " << i;
  }
  EXPECT_EQ(restarted[0].restarts, 0);
  EXPECT_EQ(restarted[1].restarts, 1);
}

INSTANTIATE_TEST_SUITE_P(KilledInStepWithChecksumEvery, NodeRestart,
                         ::testing::Values(RestartCase{1, 1}, RestartCase{1, 2}, RestartCase{2, 2},
                                           RestartCase{2, 0}),
                         [](const ::testing::TestParamInfo<RestartCase>& tested) {
                           return "Step" + std::to_string(tested.param.kill_at_step) + "Interval" +
                                  std::to_string(tested.param.checksum_interval);
                         });

TEST_F(MultiNode, DifferentModelsAreAClearErrorOnEveryNode) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("d");
  NodeRun other = run;
  other.node = 1;
  other.kind = ModelKind::kLinear;
  const auto results = runNodes({run, other});
  for (const auto& r : results) {
    EXPECT_EQ(r.outcome, kInvalidArgument) << r.what;
    EXPECT_NE(r.what.find("different model"), std::string::npos) << r.what;
  }
}

// include/gradagg/errors.h: after a NodeFailed "this node's workers are stopped [...];
// the aggregator is no longer usable", also when what failed was on another node.
void expectStoppedAndNotUsable(const NodeResult& r) {
  EXPECT_FALSE(r.usable_after) << "usable() is true after: " << r.what;
  EXPECT_EQ(r.children_after, 0) << "the node's workers were not stopped";
  EXPECT_EQ(r.retry, kNotUsable) << "the next step() ended with: " << r.retry_what;
}

TEST_F(MultiNode, AWorkerFailingOnAnotherNodeLeavesThisNodeStoppedAndNotUsable) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("g");
  run.timeout = 5000ms;  // bounds a step that would wait for a node that has gone
  NodeRun other = run;
  other.node = 1;
  other.throw_at_step = 1;
  const auto results = runNodes({run, other});
  // Node 1's own worker failed: node 1 gets the WorkerFailed.
  EXPECT_EQ(results[1].outcome, kWorkerFailed) << results[1].what;
  EXPECT_NE(results[1].what.find("bad record on node 1"), std::string::npos) << results[1].what;
  // Node 0 hears of it as a NodeFailed, after which it is not usable.
  ASSERT_EQ(results[0].outcome, kNodeFailed) << results[0].what;
  EXPECT_NE(results[0].what.find("another node"), std::string::npos) << results[0].what;
  expectStoppedAndNotUsable(results[0]);
}

TEST_F(MultiNode, ANonFiniteGradientOnAnotherNodeLeavesThisNodeStoppedAndNotUsable) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("h");
  run.timeout = 5000ms;
  NodeRun other = run;
  other.node = 1;
  other.nan_loss_at_step = 1;  // NonFinitePolicy::kRaise, the default
  const auto results = runNodes({run, other});
  // Node 1 gets its own worker's NonFiniteGradient (a WorkerFailed).
  EXPECT_EQ(results[1].outcome, kWorkerFailed) << results[1].what;
  ASSERT_EQ(results[0].outcome, kNodeFailed) << results[0].what;
  EXPECT_NE(results[0].what.find("non-finite gradient on another node"), std::string::npos)
      << results[0].what;
  expectStoppedAndNotUsable(results[0]);
}

}  // namespace
}  // namespace gradagg_test
