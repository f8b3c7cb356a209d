// Nodes agree before they start (NodeOptions' start_step, resume_identity,
// must_match): a difference is an InvalidArgument on every node that names the
// field and what each node has, before a step runs. The rendezvous honours its
// timeout: a node whose peers never come fails within it, neither much later
// nor early.
#include "node_harness.h"
#include "support/expect_throws.h"

namespace gradagg_test {
namespace {

using namespace std::chrono_literals;

// Runs two nodes that differ as `change` says; both must refuse with `field`
// and every `mentions`.
void expectRefusedOnEveryNode(NodeRun run, const std::function<void(NodeRun&)>& change,
                              const std::vector<std::string>& mentions) {
  run.nodes = 2;
  NodeRun other = run;
  other.node = 1;
  change(other);
  const auto results = runNodes({run, other});
  for (const auto& r : results) {
    EXPECT_EQ(r.outcome, kInvalidArgument) << r.what;
    EXPECT_NE(r.what.find("disagree"), std::string::npos) << r.what;
    for (const auto& m : mentions) EXPECT_NE(r.what.find(m), std::string::npos) << r.what;
  }
  // Nothing trained: both nodes still hold their initial parameters.
  const auto initial = paramsOf(*makeModel(run.kind, torch::kDouble));
  for (const auto& r : results) EXPECT_TRUE(bitIdentical(r.params, initial));
}

TEST_F(MultiNode, ANodeThatResumesWhileAnotherStartsFreshIsRefusedOnEveryNode) {
  NodeRun run;
  run.store = store("resume");
  expectRefusedOnEveryNode(
      run, [](NodeRun& n) { n.resume_identity = "0123456789abcdef-4d2"; },
      {"resume_identity", "node 0: (a fresh start)", "node 1: checkpoint 0123456789abcdef-4d2"});
}

TEST_F(MultiNode, DifferentStartStepsAreRefusedOnEveryNode) {
  NodeRun run;
  run.store = store("step");
  run.start_step = 40;
  expectRefusedOnEveryNode(run, [](NodeRun& n) { n.start_step = 60; },
                           {"start_step", "node 0: 40, node 1: 60"});
}

TEST_F(MultiNode, DifferentSettingsAreRefusedNamingTheSetting) {
  NodeRun run;
  run.store = store("seed");
  run.must_match = {{"seed", "1"}, {"epochs", "3"}};
  expectRefusedOnEveryNode(run, [](NodeRun& n) { n.must_match["seed"] = "2"; },
                           {"must_match[seed]", "node 0: 1, node 1: 2"});
  run.store = store("limit");
  expectRefusedOnEveryNode(run, [](NodeRun& n) { n.must_match["limit"] = "100"; },
                           {"must_match[limit]", "node 0: (not set), node 1: 100"});
}

TEST_F(MultiNode, DifferentStepRulesAreRefusedNamingTheRule) {
  NodeRun run;
  run.store = store("checksum");
  expectRefusedOnEveryNode(run, [](NodeRun& n) { n.checksum_interval = 5; },
                           {"checksum_interval", "node 0: 2, node 1: 5"});
  run.store = store("weighting");
  expectRefusedOnEveryNode(run, [](NodeRun& n) { n.weighting = gradagg::Weighting::kEqual; },
                           {"weighting", "node 0: samples, node 1: equal"});
}

TEST_F(MultiNode, NodesThatAgreeTrainAsOne) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("same");
  run.start_step = 12;
  run.resume_identity = "0123456789abcdef-4d2";
  run.must_match = {{"seed", "1"}};
  NodeRun other = run;
  other.node = 1;
  const auto results = runNodes({run, other});
  for (const auto& r : results) EXPECT_EQ(r.outcome, kOk) << r.what;
  EXPECT_TRUE(bitIdentical(results[0].params, results[1].params));
}

// A node alone (its peer never starts) fails with NodeFailed after about its
// timeout: not before (a late peer still counts), and within the timeout + 1 s.
void expectLoneNodeFailsOnTime(NodeRun run) {
  run.nodes = 2;
  run.timeout = 2000ms;
  const auto results = runNodes({run});
  EXPECT_EQ(results[0].outcome, kNodeFailed) << results[0].what;
  EXPECT_NE(results[0].what.find("rendezvous"), std::string::npos) << results[0].what;
  EXPECT_GE(results[0].seconds, 1.9) << results[0].what;
  EXPECT_LT(results[0].seconds, 3.0) << results[0].what;
}

TEST_F(MultiNode, AHalfPrecisionModelIsRefusedBeforeTheRendezvous) {
  // Refused on every node alike, before it waits for its peers (none comes here).
  auto model = makeModel(ModelKind::kMlp, torch::kBFloat16);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kBFloat16);
  gradagg::Options o;
  o.workers = 1;
  o.nodes.nodes = 2;
  o.nodes.store_path = store("bf16");
  o.nodes.timeout = 20s;
  const auto t0 = std::chrono::steady_clock::now();
  if (const auto e = expectThrows<gradagg::InvalidArgument>(
          [&] {
            gradagg::Aggregator agg(*model, shardFn(*model, data, {0, 8}), o);
          },
          "BFloat16")) {
    EXPECT_NE(std::string(e->what()).find("float32 and float64"), std::string::npos) << e->what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_TRUE(childPids().empty());
  EXPECT_TRUE(
      bitIdentical(paramsOf(*model), paramsOf(*makeModel(ModelKind::kMlp, torch::kBFloat16))));
}

TEST_F(MultiNode, ALoneNodeFailsWithinItsRendezvousTimeoutOverAFileStore) {
  for (int node : {0, 1}) {
    NodeRun run;
    run.node = node;
    run.store = store("alone" + std::to_string(node));
    expectLoneNodeFailsOnTime(run);
  }
}

TEST_F(MultiNode, ALoneNodeFailsWithinItsRendezvousTimeoutOverATcpStore) {
  for (int node : {0, 1}) {
    NodeRun run;
    run.node = node;
    run.master_port = freePort();
    expectLoneNodeFailsOnTime(run);
  }
}

TEST_F(MultiNode, ANodeThatStartsLateWithinTheTimeoutIsWaitedFor) {
  NodeRun run;
  run.nodes = 2;
  run.master_port = freePort();
  run.timeout = 6000ms;
  NodeRun late = run;
  late.node = 0;  // the TCPStore's server comes 2 s after its client
  late.start_delay = 2000ms;
  NodeRun early = run;
  early.node = 1;
  const auto results = runNodes({late, early});
  for (const auto& r : results) EXPECT_EQ(r.outcome, kOk) << r.what;
  EXPECT_TRUE(bitIdentical(results[0].params, results[1].params));
}

// The start-up's deadline is not the collectives': node 0 waits ~4.5 s of its
// 6 for node 1 to start, and then each collective still has the whole 6 s (here
// step 1's parameter checksum on c10d's group, which node 1 reaches 3 s late).
TEST_F(MultiNode, AfterALateStartEveryCollectiveStillHasTheWholeTimeout) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("late-collective");
  run.timeout = 6000ms;
  run.steps = 3;
  run.checksum_interval = 1;
  NodeRun early = run;
  early.node = 0;
  NodeRun late = run;
  late.node = 1;
  late.start_delay = 4500ms;
  late.pause_before_step = 1;
  late.pause = 3000ms;
  const auto results = runNodes({early, late});
  for (const auto& r : results) EXPECT_EQ(r.outcome, kOk) << r.what;
  EXPECT_TRUE(bitIdentical(results[0].params, results[1].params));
}

}  // namespace
}  // namespace gradagg_test
