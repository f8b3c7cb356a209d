// Buckets and overlap across nodes (core/buckets.h, NodeOptions::bucket_bytes
// and overlap): a gradient cut in buckets gives every node the same bits
// whether the buckets crossed during backward or after it, the same bits as
// one collective per dtype (two nodes), and one node's result; a failure
// while buckets are in flight ends every node without a hang.
#include "node_harness.h"

#include "step/buckets.h"

namespace gradagg_test {
namespace {

using gradagg::detail::BucketPlan;
using gradagg::detail::ModelBinding;
using gradagg::detail::planBuckets;

// fc1 (100 -> 50) and fc2 (50 -> 10) in float32, a float64 scale, a frozen offset.
struct Mixed : torch::nn::Module {
  Mixed() {
    fc1 = register_module("fc1", torch::nn::Linear(100, 50));
    fc2 = register_module("fc2", torch::nn::Linear(50, 10));
    register_parameter("scale", torch::ones({3}, torch::kDouble));
    register_parameter("offset", torch::zeros({4}), /*requires_grad=*/false);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// The buckets tile the flat gradient from its end down, each in one dtype.
void expectTiles(const BucketPlan& plan, const ModelBinding& binding) {
  std::uint64_t end = binding.paramBytes();
  for (int b = 0; b < plan.size(); ++b) {
    EXPECT_EQ(plan.ranges[b].end, end) << "bucket " << b;
    EXPECT_LT(plan.ranges[b].begin, plan.ranges[b].end) << "bucket " << b;
    end = plan.ranges[b].begin;
  }
  EXPECT_EQ(end, 0u);
  const auto& params = binding.params();
  for (std::size_t k = 0; k < params.size(); ++k) {
    const int b = plan.of_param[k];
    if (!params[k].requires_grad) {
      EXPECT_EQ(b, -1) << params[k].name;
      continue;
    }
    ASSERT_GE(b, 0) << params[k].name;
    EXPECT_GE(params[k].offset, plan.ranges[b].begin) << params[k].name;
    EXPECT_LE(params[k].offset + params[k].bytes, plan.ranges[b].end) << params[k].name;
    EXPECT_EQ(params[k].dtype, plan.dtypes[b]) << params[k].name;
  }
}

int bucketOf(const BucketPlan& plan, const ModelBinding& binding, const std::string& name) {
  for (std::size_t k = 0; k < binding.params().size(); ++k)
    if (binding.params()[k].name == name) return plan.of_param[k];
  ADD_FAILURE() << "no parameter " << name;
  return -2;
}

TEST(Buckets, ReverseRegistrationOrderOneDtypeEachClosedAtTheSize) {
  Mixed model;
  const ModelBinding binding(gradagg::viewOf(model));
  // fc2.bias 40 B, fc2.weight 2000 B, fc1.bias 200 B, fc1.weight 20000 B.
  const BucketPlan plan = planBuckets(binding, 2100, 2100, true);
  expectTiles(plan, binding);
  ASSERT_EQ(plan.size(), 3);
  EXPECT_EQ(plan.dtype_runs, 2);
  EXPECT_EQ(bucketOf(plan, binding, "scale"), 0) << "float64 is laid out last: it crosses first";
  EXPECT_EQ(bucketOf(plan, binding, "fc2.bias"), 1);
  EXPECT_EQ(bucketOf(plan, binding, "fc2.weight"), 1);
  EXPECT_EQ(bucketOf(plan, binding, "fc1.bias"), 1) << "2040 B < 2100 B: still open";
  EXPECT_EQ(bucketOf(plan, binding, "fc1.weight"), 2);
  EXPECT_EQ(plan.early(), 2);
  EXPECT_EQ(plan.workerPart(binding.paramBytes()).begin, plan.ranges[2].begin);
  EXPECT_EQ(planBuckets(binding, 2100, 2100, false).early(), 0) << "overlap off";
  // DDP's small first bucket: fc2.bias alone (40 B >= 16 B), then the rest of float32.
  const BucketPlan first = planBuckets(binding, 16, 25ull << 20, true);
  expectTiles(first, binding);
  ASSERT_EQ(first.size(), 3);
  EXPECT_EQ(bucketOf(first, binding, "scale"), 0) << "float64's first bucket";
  EXPECT_EQ(bucketOf(first, binding, "fc2.bias"), 1) << "float32's first bucket";
  EXPECT_EQ(bucketOf(first, binding, "fc2.weight"), 2);
  EXPECT_EQ(bucketOf(first, binding, "fc1.weight"), 2);
}

TEST(Buckets, AModelThatFitsOneBucketPerDtypeCrossesWhole) {
  Mixed model;
  const ModelBinding binding(gradagg::viewOf(model));
  const BucketPlan plan = planBuckets(binding, 25ull << 20, 25ull << 20, true);
  expectTiles(plan, binding);
  EXPECT_TRUE(plan.whole());
  EXPECT_EQ(plan.size(), 2);
  EXPECT_EQ(plan.early(), 0);
  EXPECT_EQ(plan.workerPart(binding.paramBytes()).begin, 0u) << "the workers reduce it all";
}

TEST(Buckets, TooManyBucketsGrowUntilTheHeaderHasALineForEach) {
  torch::nn::Sequential many;
  for (int i = 0; i < 100; ++i) many->push_back(torch::nn::Linear(1, 1));
  const ModelBinding binding(gradagg::viewOf(*many));
  const BucketPlan plan = planBuckets(binding, 1, 1, true);
  expectTiles(plan, binding);
  EXPECT_LE(plan.early(), gradagg::detail::kMaxEarlyBuckets);
  EXPECT_GT(plan.early(), gradagg::detail::kMaxEarlyBuckets / 4);
}

// Every parameter of the test MLP (the smallest, fc2.bias, is 32 bytes) is a
// bucket of its own: three early buckets and the last.
constexpr std::uint64_t kTinyBuckets = 16;

std::vector<NodeResult> nodesOf(NodeRun run, int nodes, const std::string& store) {
  run.nodes = nodes;
  run.store = store;
  std::vector<NodeRun> runs;
  for (int r = 0; r < nodes; ++r) {
    runs.push_back(run);
    runs.back().node = r;
  }
  return runNodes(runs);
}

// Node 0 runs `faulty`, node 1 the same run without its fault, with tiny buckets.
std::vector<NodeResult> faultyAndHealthy(NodeRun faulty, const std::string& store) {
  faulty.bucket_bytes = kTinyBuckets;
  faulty.nodes = 2;
  faulty.store = store;
  NodeRun healthy = faulty;
  healthy.node = 1;
  healthy.kill_worker_in_backward_at_step = healthy.throw_at_step = -1;
  return runNodes({faulty, healthy});
}

void expectAllOk(const std::vector<NodeResult>& results) {
  for (std::size_t r = 0; r < results.size(); ++r)
    ASSERT_EQ(results[r].outcome, kOk) << "node " << r << ": " << results[r].what;
}

TEST_F(MultiNode, BucketsGiveTheSameBitsDuringOrAfterBackwardAndMatchOneNode) {
  NodeRun run;
  run.bucket_bytes = kTinyBuckets;
  run.unequal = true;
  run.slow_first_layer_ms = 20;  // backward of the first layer takes 20 ms
  const auto overlapped = nodesOf(run, 2, store("overlap"));
  run.overlap = false;
  const auto after = nodesOf(run, 2, store("after"));
  run.bucket_bytes = 25ull << 20;  // one collective with the status, as before buckets
  const auto whole = nodesOf(run, 2, store("whole"));
  expectAllOk(overlapped);
  expectAllOk(after);
  expectAllOk(whole);
  EXPECT_TRUE(bitIdentical(overlapped[0].params, overlapped[1].params)) << "the nodes agree";
  EXPECT_TRUE(bitIdentical(overlapped[0].params, after[0].params)) << "overlap changes when only";
  // Two nodes: each element is a + b whichever collective carries it.
  EXPECT_TRUE(bitIdentical(overlapped[0].params, whole[0].params)) << "buckets vs one collective";
  expectClose(overlapped[0].params, trainOneNode(4, run), 1e-12, "2 nodes x 2 vs one node of 4");
  EXPECT_EQ(overlapped[0].node_bytes, whole[0].node_bytes) << "the same bytes, in more pieces";
  EXPECT_EQ(overlapped[0].collectives, 5) << "4 buckets and the status";
  EXPECT_EQ(whole[0].collectives, 1);
  // fc2's two buckets, at least, crossed while fc1's backward slept, every step.
  for (const auto& r : overlapped) EXPECT_GE(r.overlapped, 2 * run.steps);
  EXPECT_EQ(after[0].overlapped, 0);
  EXPECT_EQ(whole[0].overlapped, 0);
}

TEST_F(MultiNode, ThreeNodesWithBucketsAgreeAndOverlapChangesNoBit) {
  NodeRun run;
  run.dtype = torch::kFloat;
  run.workers = 1;
  run.batch = 18;
  run.bucket_bytes = kTinyBuckets;
  const auto overlapped = nodesOf(run, 3, store("overlap"));
  run.overlap = false;
  const auto after = nodesOf(run, 3, store("after"));
  expectAllOk(overlapped);
  expectAllOk(after);
  for (int r = 1; r < 3; ++r)
    EXPECT_TRUE(bitIdentical(overlapped[0].params, overlapped[r].params)) << "node " << r;
  EXPECT_TRUE(bitIdentical(overlapped[0].params, after[0].params));
  expectClose(overlapped[0].params, trainOneNode(3, run), 1e-5, "3 nodes x 1 vs one node of 3");
}

TEST_F(MultiNode, BucketsWithAccumulationAndBf16OnTheWire) {
  NodeRun run;
  run.dtype = torch::kFloat;
  run.accumulation_steps = 2;
  run.unequal = true;
  run.bucket_bytes = kTinyBuckets;
  const auto overlapped = nodesOf(run, 2, store("overlap"));
  expectAllOk(overlapped);
  EXPECT_TRUE(bitIdentical(overlapped[0].params, overlapped[1].params));
  expectClose(overlapped[0].params, trainOneNode(4, run), 1e-5, "accumulating, 2 x 2 vs 1 x 4");
  run.compression = gradagg::Compression::kBFloat16;
  const auto bf16 = nodesOf(run, 2, store("bf16"));
  run.overlap = false;
  const auto bf16_after = nodesOf(run, 2, store("bf16-after"));
  expectAllOk(bf16);
  expectAllOk(bf16_after);
  EXPECT_TRUE(bitIdentical(bf16[0].params, bf16[1].params));
  EXPECT_TRUE(bitIdentical(bf16[0].params, bf16_after[0].params));
  expectClose(bf16[0].params, overlapped[0].params, 1e-2, "bf16 buckets vs float32 buckets");
}

TEST_F(MultiNode, AShardFunctionThatDropsGradStillGetsEveryBucketRight) {
  // Autograd then accumulates outside the slots: no bucket may go early with
  // what the slot holds; the worker copies at the end and the lines follow.
  NodeRun run;
  run.bucket_bytes = kTinyBuckets;
  const auto plain = nodesOf(run, 2, store("plain"));
  run.drop_grads = true;
  const auto dropped = nodesOf(run, 2, store("dropped"));
  expectAllOk(plain);
  expectAllOk(dropped);
  EXPECT_TRUE(bitIdentical(plain[0].params, dropped[0].params));
  EXPECT_TRUE(bitIdentical(dropped[0].params, dropped[1].params));
}

TEST_F(MultiNode, AWorkerDyingWhileBucketsAreInFlightEndsEveryNodeAtOnce) {
  NodeRun dying;
  dying.steps = 3;
  dying.timeout = std::chrono::milliseconds(20000);
  dying.kill_worker_in_backward_at_step = 1;
  const auto results = faultyAndHealthy(dying, store("a"));
  // Its buckets were on the wire: the node cannot redo the step with fresh
  // workers (the other node refused it already).
  EXPECT_EQ(results[0].outcome, kWorkerDied) << results[0].what;
  EXPECT_NE(results[0].what.find("worker 1"), std::string::npos) << results[0].what;
  EXPECT_EQ(results[1].outcome, kNodeFailed) << results[1].what;
  EXPECT_NE(results[1].what.find("another node failed in step 1"), std::string::npos)
      << results[1].what;
  EXPECT_FALSE(results[1].usable_after);
  EXPECT_EQ(results[1].children_after, 0);
  for (const auto& r : results) EXPECT_LT(r.seconds, 10.0) << "well within the 20 s node timeout";
}

TEST_F(MultiNode, AWorkerThrowingWithBucketsFailsTheStepOnEveryNode) {
  NodeRun throwing;
  throwing.throw_at_step = 2;
  const auto results = faultyAndHealthy(throwing, store("a"));
  EXPECT_EQ(results[0].outcome, kWorkerFailed) << results[0].what;
  EXPECT_EQ(results[1].outcome, kNodeFailed) << results[1].what;
}

// A parameter whose gradient is accumulated twice in one backward (a reentrant
// backward over it besides the model's own use): with overlap its bucket left
// after the first accumulation (the model's last parameter is the first bucket,
// complete as soon as the reentrant part ran), so the step fails naming it
// rather than sum a partial
// gradient across the nodes. With the buckets after backward the same training
// runs: the nodes agree and match one node.
TEST_F(MultiNode, AGradientAccumulatedTwiceAfterItsBucketLeftFailsTheStep) {
  NodeRun run;
  run.bucket_bytes = kTinyBuckets;
  run.reentrant_last_param = true;
  run.steps = 2;
  const auto overlapped = nodesOf(run, 2, store("overlap"));
  bool named = false;
  for (const auto& r : overlapped) {
    EXPECT_NE(r.outcome, kOk);
    named = named || r.what.find("got its gradient twice in one backward") != std::string::npos;
  }
  EXPECT_TRUE(named) << overlapped[0].what << "\n" << overlapped[1].what;
  run.overlap = false;
  const auto after = nodesOf(run, 2, store("after"));
  expectAllOk(after);
  EXPECT_TRUE(bitIdentical(after[0].params, after[1].params));
  expectClose(after[0].params, trainOneNode(4, run), 1e-12, "2 nodes x 2 vs one node of 4");
}

}  // namespace
}  // namespace gradagg_test
