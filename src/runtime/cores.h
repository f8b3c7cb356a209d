// How many CPUs a cgroup's quota gives this process.
#pragma once

#include <string>

namespace gradagg::detail {

// The quota of the cgroup this process is in, and of every cgroup above it,
// as whole CPUs (rounded up; the tightest wins), or 0 where none is set.
// cgroup v2: cpu.max ("max 100000" or "<quota> <period>") under
// <cgroup_fs>/<path>; v1: cpu.cfs_quota_us / cpu.cfs_period_us of the cpu
// controller's hierarchy (<cgroup_fs>/cpu,cpuacct or <cgroup_fs>/cpu). The
// paths come from `self_cgroup` (/proc/self/cgroup's format); the arguments
// are there for tests.
int cgroupCpuQuota(const std::string& cgroup_fs = "/sys/fs/cgroup",
                   const std::string& self_cgroup = "/proc/self/cgroup");

}  // namespace gradagg::detail
