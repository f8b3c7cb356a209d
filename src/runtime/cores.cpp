#include "runtime/cores.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <vector>

namespace gradagg::detail {

namespace {

std::string firstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// CPUs of quota / period, rounded up; 0 for no limit or nonsense.
int cpusOf(long long quota, long long period) {
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>(std::ceil(static_cast<double>(quota) / static_cast<double>(period)));
}

// `dir` and each directory above it up to `root`, the tightest limit `read` finds.
template <typename Read>
int tightest(const std::string& root, std::string path, Read read) {
  int best = 0;
  for (;;) {
    const int cpus = read(root + path);
    if (cpus > 0) best = best == 0 ? cpus : std::min(best, cpus);
    if (path.empty() || path == "/") return best;
    const auto slash = path.rfind('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
}

int readV2(const std::string& dir) {
  std::istringstream max(firstLine(dir + "/cpu.max"));
  std::string quota;
  long long period = 0;
  if (!(max >> quota >> period) || quota == "max") return 0;
  try {
    return cpusOf(std::stoll(quota), period);
  } catch (const std::exception&) {
    return 0;
  }
}

int readV1(const std::string& dir) {
  try {
    const std::string quota = firstLine(dir + "/cpu.cfs_quota_us");
    const std::string period = firstLine(dir + "/cpu.cfs_period_us");
    if (quota.empty() || period.empty()) return 0;
    return cpusOf(std::stoll(quota), std::stoll(period));
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

int cgroupCpuQuota(const std::string& cgroup_fs, const std::string& self_cgroup) {
  std::ifstream in(self_cgroup);
  int best = 0;
  const auto take = [&best](int cpus) {
    if (cpus > 0) best = best == 0 ? cpus : std::min(best, cpus);
  };
  for (std::string line; std::getline(in, line);) {
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {
      take(tightest(cgroup_fs, path, readV2));
      continue;
    }
    std::vector<std::string> names;
    std::istringstream list(controllers);
    for (std::string n; std::getline(list, n, ',');) names.push_back(n);
    if (std::find(names.begin(), names.end(), "cpu") == names.end()) continue;
    for (const std::string& mount : {controllers, std::string("cpu,cpuacct"), std::string("cpu")}) {
      std::string dir = cgroup_fs;
      dir += '/';
      dir += mount;
      take(tightest(dir, path, readV1));
    }
  }
  return best;
}

}  // namespace gradagg::detail
