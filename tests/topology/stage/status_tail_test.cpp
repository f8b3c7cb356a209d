// The status tail (topology/stage/status_tail.h): what a node writes is what
// the sum over the nodes reads back, in float32 and float64.
#include <gtest/gtest.h>

#include <vector>

#include "topology/stage/status_tail.h"

namespace gradagg::detail {
namespace {

Contribution node(std::int64_t samples, int metric_names, std::vector<std::uint8_t> has_grad) {
  Contribution c;
  c.sums.weight_total = static_cast<double>(samples);
  c.sums.samples = samples;
  c.sums.loss = 0.5 * static_cast<double>(samples);  // sum_i n_i loss_i with loss 0.5
  c.sums.metrics.count = metric_names;
  c.has_grad = std::move(has_grad);
  return c;
}

// Each node's tail summed element-wise: what the allreduce leaves on every node.
template <typename T>
NodeStatus sumOver(const std::vector<Contribution>& nodes, std::size_t params) {
  const std::size_t count = kStatusFields + params;
  std::vector<T> sum(count, 0), tail(count, 0);
  for (const Contribution& c : nodes) {
    writeStatus<T>(reinterpret_cast<std::byte*>(tail.data()), c);
    for (std::size_t i = 0; i < count; ++i) sum[i] += tail[i];
  }
  return readStatus<T>(reinterpret_cast<const std::byte*>(sum.data()), params);
}

template <typename T>
void checkThreeNodes() {
  // Samples past 2^24 (float32's exact integers) stay exact as two parts.
  const std::int64_t big = (std::int64_t{1} << 30) + 3;
  std::vector<Contribution> nodes = {node(big, 2, {kDenseGrad, kSparseGrad, 0}),
                                     node(5, 2, {kSparseGrad, kSparseGrad, 0}),
                                     node(0, 0, {0, 0, 0})};
  const NodeStatus all = sumOver<T>(nodes, 3);
  EXPECT_FALSE(all.failed);
  EXPECT_FALSE(all.non_finite);
  EXPECT_EQ(all.sums.samples, big + 5);
  EXPECT_EQ(all.sums.weight_total, static_cast<double>(big + 5));
  EXPECT_NEAR(all.sums.loss, 0.5, 1e-6);
  EXPECT_EQ(all.metric_nodes, 2);  // the node without samples has no metrics
  EXPECT_EQ(all.metric_names, 4);
  EXPECT_EQ(all.has_grad, (std::vector<std::uint8_t>{kDenseGrad | kSparseGrad, kSparseGrad, 0}));

  nodes[2].non_finite_rank = 1;
  EXPECT_TRUE(sumOver<T>(nodes, 3).non_finite);
  EXPECT_FALSE(sumOver<T>(nodes, 3).failed);
  nodes[1].abandoned = true;
  EXPECT_TRUE(sumOver<T>(nodes, 3).failed);
}

TEST(StatusTail, ThreeNodesSumToEveryonesStatusInFloat32) { checkThreeNodes<float>(); }
TEST(StatusTail, ThreeNodesSumToEveryonesStatusInFloat64) { checkThreeNodes<double>(); }

}  // namespace
}  // namespace gradagg::detail
