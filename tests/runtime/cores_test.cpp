// The CPU quota of a cgroup (runtime/cores.h), read from fake cgroup trees in
// the formats of cgroup v2 and v1; availableCores() takes the tighter of it
// and the affinity mask.
#include <sched.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include <gradagg/options.h>

#include "runtime/cores.h"
#include "runtime/temp_dir.h"

namespace {

using gradagg::detail::cgroupCpuQuota;
using gradagg::detail::TempDir;

void write(const std::string& path, const std::string& text) {
  std::ofstream(path) << text << "\n";
}

void makeDirs(const std::string& path) { std::filesystem::create_directories(path); }

TEST(CgroupQuota, V2TheTightestQuotaOnThePathRoundedUp) {
  TempDir dir("cgroup");
  const std::string fs = dir.path();
  makeDirs(fs + "/job/step");
  write(fs + "/self", "0::/job/step");
  write(fs + "/cpu.max", "max 100000");
  EXPECT_EQ(cgroupCpuQuota(fs, fs + "/self"), 0);  // no limit anywhere
  write(fs + "/job/cpu.max", "300000 100000");
  EXPECT_EQ(cgroupCpuQuota(fs, fs + "/self"), 3);
  write(fs + "/job/step/cpu.max", "150000 100000");  // 1.5 CPUs: 2 threads can use them
  EXPECT_EQ(cgroupCpuQuota(fs, fs + "/self"), 2);
  write(fs + "/job/step/cpu.max", "max 100000");
  EXPECT_EQ(cgroupCpuQuota(fs, fs + "/self"), 3);
}

TEST(CgroupQuota, V1TheCpuControllersQuota) {
  TempDir dir("cgroup");
  const std::string fs = dir.path();
  makeDirs(fs + "/cpu,cpuacct/docker/abc");
  write(fs + "/self", "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/");
  write(fs + "/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1");
  write(fs + "/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000");
  EXPECT_EQ(cgroupCpuQuota(fs, fs + "/self"), 0);
  write(fs + "/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "100000");
  EXPECT_EQ(cgroupCpuQuota(fs, fs + "/self"), 1);
}

TEST(CgroupQuota, MissingOrGarbledFilesMeanNoLimit) {
  TempDir dir("cgroup");
  const std::string fs = dir.path();
  EXPECT_EQ(cgroupCpuQuota(fs, fs + "/no-such-file"), 0);
  write(fs + "/self", "0::/");
  write(fs + "/cpu.max", "lots of cpus");
  EXPECT_EQ(cgroupCpuQuota(fs, fs + "/self"), 0);
}

TEST(CgroupQuota, AvailableCoresIsAtLeastOneAndAtMostTheAffinityMask) {
  const int cores = gradagg::availableCores();
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_GE(cores, 1);
  EXPECT_LE(cores, CPU_COUNT(&set));
}

}  // namespace
