#include <gtest/gtest.h>

#include "topology/topology.h"

namespace gradagg::detail {
namespace {

Placement onHost(int host_workers, int host_nodes) {
  Placement p;
  p.host_workers = host_workers;
  p.host_nodes = host_nodes;
  return p;
}

TEST(ParentHasOwnCore, OnlyWhenEveryWorkerThreadAndEveryParentFitTheCores) {
  // Fashion-MNIST's one worker of one thread on 2 cores: the parent spins.
  EXPECT_TRUE(parentHasOwnCore(onHost(1, 1), 1, 2));
  // One worker with the default threads (both cores), or two workers: it sleeps.
  EXPECT_FALSE(parentHasOwnCore(onHost(1, 1), 2, 2));
  EXPECT_FALSE(parentHasOwnCore(onHost(2, 1), 1, 2));
  // Two nodes of one worker sharing 2 cores (the multi-node tests): four processes.
  EXPECT_FALSE(parentHasOwnCore(onHost(2, 2), 1, 2));
  EXPECT_TRUE(parentHasOwnCore(onHost(2, 2), 1, 4));
  EXPECT_TRUE(parentHasOwnCore(onHost(3, 1), 2, 8));
  EXPECT_FALSE(parentHasOwnCore(onHost(4, 1), 2, 8));
}

}  // namespace
}  // namespace gradagg::detail
