// NodeOptions::compression = kBFloat16: float32 gradients cross the nodes as
// bf16 (half the bytes), every node still takes the same step bit for bit, and
// the result stays within bf16's rounding of the uncompressed one; float64
// gradients are never compressed.
#include "node_harness.h"

namespace gradagg_test {
namespace {

std::uint64_t elements(const std::vector<torch::Tensor>& params) {
  std::uint64_t n = 0;
  for (const auto& p : params) n += static_cast<std::uint64_t>(p.numel());
  return n;
}

std::vector<NodeResult> twoNodes(NodeRun run) {
  run.nodes = 2;
  NodeRun other = run;
  other.node = 1;
  return runNodes({run, other});
}

// The same two-node training without and with bf16 on the wire, each over its own store.
std::pair<std::vector<NodeResult>, std::vector<NodeResult>> withoutAndWithBf16(
    NodeRun run, const std::string& full_store, const std::string& bf16_store) {
  run.store = full_store;
  auto full = twoNodes(run);
  run.compression = gradagg::Compression::kBFloat16;
  run.store = bf16_store;
  return {std::move(full), twoNodes(run)};
}

TEST_F(MultiNode, Bf16OnTheWireHalvesTheBytesAndStaysCloseToFullPrecision) {
  NodeRun run;
  run.dtype = torch::kFloat;
  run.steps = 4;
  const auto [full, bf16] = withoutAndWithBf16(run, store("full"), store("bf16"));
  for (const auto& r : full) ASSERT_EQ(r.outcome, kOk) << r.what;
  for (const auto& r : bf16) ASSERT_EQ(r.outcome, kOk) << r.what;
  EXPECT_TRUE(bitIdentical(bf16[0].params, bf16[1].params)) << "the nodes agree bit for bit";
  EXPECT_FALSE(bitIdentical(bf16[0].params, full[0].params)) << "the gradients were rounded";
  // 4 SGD steps from gradients rounded to bf16 (8 bits of mantissa, 2^-9 relative).
  expectClose(bf16[0].params, full[0].params, 1e-2, "bf16 on the wire vs float32");
  EXPECT_LT(static_cast<double>(bf16[0].node_bytes), 0.55 * static_cast<double>(full[0].node_bytes))
      << bf16[0].node_bytes << " bytes with bf16, " << full[0].node_bytes << " without";
  // Every gradient element travels, as 2 bytes (the status, as float32, besides).
  EXPECT_GE(bf16[0].node_bytes, 2 * elements(bf16[0].params));
}

TEST_F(MultiNode, Float64GradientsAreNeverCompressed) {
  NodeRun run;  // float64
  const auto [full, bf16] = withoutAndWithBf16(run, store("full"), store("bf16"));
  for (const auto& r : bf16) ASSERT_EQ(r.outcome, kOk) << r.what;
  EXPECT_TRUE(bitIdentical(bf16[0].params, full[0].params));
  EXPECT_GE(bf16[0].node_bytes, 8 * elements(bf16[0].params)) << "as float64, 8 bytes each";
}

TEST_F(MultiNode, NodesThatCompressDifferentlyAreRefusedOnEveryNode) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("mixed");
  NodeRun other = run;
  other.node = 1;
  other.compression = gradagg::Compression::kBFloat16;
  for (const auto& r : runNodes({run, other})) {
    EXPECT_EQ(r.outcome, kInvalidArgument) << r.what;
    EXPECT_NE(r.what.find("disagree on compression"), std::string::npos) << r.what;
    EXPECT_NE(r.what.find("node 0: none, node 1: bf16"), std::string::npos) << r.what;
  }
}

}  // namespace
}  // namespace gradagg_test
