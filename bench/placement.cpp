#include "placement.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <vector>

namespace gradagg::bench {

ClusterMachine enterMachine(const Placement& placement, int k) {
  if (placement.cluster.empty()) return {"lo", "127.0.0.1"};
  const int m = k % 2;
  const std::string ns = "/run/netns/" + placement.cluster + "n" + std::to_string(m);
  const int fd = ::open(ns.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0)
    throw std::system_error(errno, std::generic_category(), "gradagg-bench: entering " + ns);
  ::close(fd);
  return {placement.cluster + "v" + std::to_string(m), "10.213.0." + std::to_string(m + 1)};
}

void pinTo(const Placement& placement, int k, int n) {
  if (!placement.pin) return;
  cpu_set_t all;
  CPU_ZERO(&all);
  if (::sched_getaffinity(0, sizeof(all), &all) != 0)
    throw std::system_error(errno, std::generic_category(), "gradagg-bench: sched_getaffinity");
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &all)) cpus.push_back(c);
  const int count = static_cast<int>(cpus.size());
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (count >= n) {
    for (int i = k * count / n; i < (k + 1) * count / n; ++i) CPU_SET(cpus[i], &mine);
  } else {
    CPU_SET(cpus[k % count], &mine);
  }
  if (::sched_setaffinity(0, sizeof(mine), &mine) != 0)
    throw std::system_error(errno, std::generic_category(), "gradagg-bench: sched_setaffinity");
}

}  // namespace gradagg::bench
