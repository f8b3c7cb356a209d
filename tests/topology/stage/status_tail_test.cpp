// The status tail (topology/stage/status_tail.h): what a node writes is what
// the sum over the nodes reads back, in float32 and float64.
#include <gtest/gtest.h>

#include <vector>

#include "topology/stage/status_tail.h"

namespace gradagg::detail {
namespace {

Contribution node(std::int64_t samples, int metric_names,
                  const std::vector<std::uint8_t>& has_grad) {
  Contribution c;
  c.sums.weight_total = static_cast<double>(samples);
  c.sums.samples = samples;
  c.sums.loss = 0.5 * static_cast<double>(samples);  // sum_i n_i loss_i with loss 0.5
  c.sums.metrics.count = metric_names;
  c.has_grad = has_grad;  // a view: the caller keeps the flags
  return c;
}

// Each node's tail summed element-wise: what the allreduce leaves on every node.
template <typename T>
NodeStatus sumOver(const std::vector<Contribution>& nodes, std::vector<std::uint8_t>& has_grad) {
  const std::size_t params = has_grad.size();
  const std::size_t count = kStatusFields + params;
  std::vector<T> sum(count, 0), tail(count, 0);
  for (const Contribution& c : nodes) {
    writeStatus<T>(reinterpret_cast<std::byte*>(tail.data()), c, params);
    for (std::size_t i = 0; i < count; ++i) sum[i] += tail[i];
  }
  return readStatus<T>(reinterpret_cast<const std::byte*>(sum.data()), has_grad.data(), params);
}

template <typename T>
void checkThreeNodes() {
  // Samples past 2^24 (float32's exact integers) stay exact as two parts.
  const std::int64_t big = (std::int64_t{1} << 30) + 3;
  const std::vector<std::uint8_t> flags[] = {
      {kDenseGrad, kSparseGrad, 0}, {kSparseGrad, kSparseGrad, 0}, {0, 0, 0}};
  std::vector<Contribution> nodes = {node(big, 2, flags[0]), node(5, 2, flags[1]),
                                     node(0, 0, flags[2])};
  nodes[2].has_grad = {};  // a node without flags (one that gave up) counts none
  std::vector<std::uint8_t> has_grad(3, 0xff);
  const NodeStatus all = sumOver<T>(nodes, has_grad);
  EXPECT_FALSE(all.failed);
  EXPECT_FALSE(all.non_finite);
  EXPECT_EQ(all.sums.samples, big + 5);
  EXPECT_EQ(all.sums.weight_total, static_cast<double>(big + 5));
  EXPECT_NEAR(all.sums.loss, 0.5, 1e-6);
  EXPECT_EQ(all.metric_nodes, 2);  // the node without samples has no metrics
  EXPECT_EQ(all.metric_names, 4);
  EXPECT_EQ(has_grad, (std::vector<std::uint8_t>{kDenseGrad | kSparseGrad, kSparseGrad, 0}));

  nodes[2].non_finite_rank = 1;
  EXPECT_TRUE(sumOver<T>(nodes, has_grad).non_finite);
  EXPECT_FALSE(sumOver<T>(nodes, has_grad).failed);
  nodes[1].abandoned = true;
  EXPECT_TRUE(sumOver<T>(nodes, has_grad).failed);
}

TEST(StatusTail, ThreeNodesSumToEveryonesStatusInFloat32) { checkThreeNodes<float>(); }
TEST(StatusTail, ThreeNodesSumToEveryonesStatusInFloat64) { checkThreeNodes<double>(); }

}  // namespace
}  // namespace gradagg::detail
