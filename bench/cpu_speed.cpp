#include "cpu_speed.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <sstream>
#include <thread>

#include "report.h"  // median

namespace gradagg::bench {

namespace {

constexpr int kRows = 16, kInner = 2048, kCols = 2048, kRepeats = 7;

// c += a * w, row by row (the loop order of a reference BLAS gemm): 67M
// multiply-adds streaming a 16 MB w 16 times, as a 2048x2048 layer's weights
// are streamed from the last-level cache and memory; so the kernel feels the
// host's other tenants there too, not only on the core.
double kernelMs(const std::vector<float>& a, const std::vector<float>& w, std::vector<float>& c) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kRows; ++i)
    for (int k = 0; k < kInner; ++k) {
      const float aik = a[i * kInner + k];
      const float* wk = &w[static_cast<std::size_t>(k) * kCols];
      float* ci = &c[static_cast<std::size_t>(i) * kCols];
      for (int j = 0; j < kCols; ++j) ci[j] += aik * wk[j];
    }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The kernel's median on `cpu`, from a thread pinned there; -1 if it cannot be pinned.
double measureOn(int cpu) {
  double ms = -1;
  std::thread probe([cpu, &ms] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (pthread_setaffinity_np(pthread_self(), sizeof(one), &one) != 0) return;
    std::vector<float> a(kRows * kInner, 0.5f), w(kInner * kCols, 0.25f), c(kRows * kCols, 0.f);
    kernelMs(a, w, c);  // warm the caches and the page tables
    std::vector<double> times;
    for (int r = 0; r < kRepeats; ++r) times.push_back(kernelMs(a, w, c));
    volatile float sink = c[0];  // the products are used
    (void)sink;
    ms = median(times);
  });
  probe.join();
  return ms;
}

}  // namespace

std::vector<CpuSpeed> measureCpuSpeeds() {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  std::vector<CpuSpeed> speeds;
  if (sched_getaffinity(0, sizeof(mine), &mine) != 0) return speeds;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &mine)) continue;
    const double ms = measureOn(cpu);
    if (ms >= 0) speeds.push_back({cpu, ms});
  }
  return speeds;
}

double spread(const std::vector<CpuSpeed>& speeds) {
  if (speeds.empty()) return 1.0;
  const auto [fastest, slowest] = std::minmax_element(
      speeds.begin(), speeds.end(), [](const CpuSpeed& a, const CpuSpeed& b) { return a.ms < b.ms; });
  return slowest->ms / fastest->ms;
}

std::string describe(const std::vector<CpuSpeed>& speeds) {
  if (speeds.empty()) return "not measured";
  std::ostringstream s;
  s << std::setprecision(3);
  for (const CpuSpeed& c : speeds)
    s << (&c == &speeds.front() ? "" : ", ") << "cpu" << c.cpu << " " << c.ms << " ms";
  if (speeds.size() > 1)
    s << std::fixed << std::setprecision(2) << " (the slowest " << spread(speeds) << "x the fastest)";
  return s.str();
}

}  // namespace gradagg::bench
