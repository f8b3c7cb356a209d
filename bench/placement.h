// Where a forked node or Gloo peer runs: its part of the CPUs (--pin) and its
// network (--cluster, an emulated cluster from tests/cluster/cluster.sh, else
// loopback). Both are applied in the child, before it computes or opens a socket.
#pragma once

#include <string>

namespace gradagg::bench {

struct Placement {
  // Part k of n of the CPUs this process may use, for node or peer k (round
  // robin when there are more processes than CPUs): processes of different
  // nodes then never share a core, as when each node of a host is given its own
  // CPUs (taskset, a launcher's CPU binding). Off: the kernel places them
  // (docs/benchmark.md: small steps across nodes are slower then; why is not traced).
  bool pin = false;
  // The prefix `cluster.sh up 2 RATE` prints: node or peer k enters machine
  // k % 2's network namespace (PREFIXn<m>) and talks over its rate-limited veth
  // (PREFIXv<m>, 10.213.0.<m+1>), so that the cross-node traffic of the
  // shm-2nodes and gloo rows crosses the emulated link. Empty: loopback.
  std::string cluster;
};

struct ClusterMachine {
  std::string interface, address;
};

// Enters node or peer k's network namespace (a no-op on loopback) and returns its
// interface and address. setns() moves the calling thread, the child's only one
// so far; threads it starts later inherit the namespace.
ClusterMachine enterMachine(const Placement& placement, int k);
// Restricts this process to part k of n of its CPUs when `placement.pin`.
void pinTo(const Placement& placement, int k, int n);

}  // namespace gradagg::bench
