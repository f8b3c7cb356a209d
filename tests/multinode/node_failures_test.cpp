// A node that fails ends the step on every node with a named error: a killed or
// stalled node (within the timeout), diverged parameters, different models.
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
  EXPECT_GE(results[0].seconds, 2.0);        // it waited for the deadline...
  EXPECT_LT(results[0].seconds, 2.0 + 15.0);  // ...and not much longer
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

}  // namespace
}  // namespace gradagg_test
