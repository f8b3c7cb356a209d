#include "cpu_speed.h"

#include <pthread.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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

// The kernel's median on every CPU of `mine`, in this process (the child's side).
std::vector<CpuSpeed> measureHere(const cpu_set_t& mine) {
  std::vector<CpuSpeed> speeds;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &mine)) continue;
    const double ms = measureOn(cpu);
    if (ms >= 0) speeds.push_back({cpu, ms});
  }
  return speeds;
}

}  // namespace

// In a forked child, so that the bench's own process is left as it was: a
// probe in the bench's process freed its 16 MB buffers, which raised glibc's
// mmap threshold for every later mode (the CNN's one-process step went from
// ~110 to ~52 ms, 2026-12-06), and its pinned threads moved where the
// scheduler put the bench's threads next. The child only runs the kernel and
// writes its results to a pipe; the parent waits for it.
std::vector<CpuSpeed> measureCpuSpeeds() {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  std::vector<CpuSpeed> speeds;
  if (sched_getaffinity(0, sizeof(mine), &mine) != 0) return speeds;
  int fds[2];
  if (::pipe(fds) != 0) return speeds;
  const pid_t child = ::fork();
  if (child < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return speeds;
  }
  if (child == 0) {
    ::close(fds[0]);
    const std::vector<CpuSpeed> found = measureHere(mine);
    const auto bytes = static_cast<ssize_t>(found.size() * sizeof(CpuSpeed));
    const bool whole = bytes == 0 || ::write(fds[1], found.data(), bytes) == bytes;
    ::_exit(whole ? 0 : 1);  // no atexit handlers, no destructors of the parent's objects
  }
  ::close(fds[1]);
  CpuSpeed one{};
  ssize_t got = 0;
  while ((got = ::read(fds[0], &one, sizeof one)) == sizeof one) speeds.push_back(one);
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  const bool ok = got == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return ok ? speeds : std::vector<CpuSpeed>{};
}

double spread(const std::vector<CpuSpeed>& speeds) {
  if (speeds.empty()) return 1.0;
  const auto [fastest, slowest] =
      std::minmax_element(speeds.begin(), speeds.end(),
                          [](const CpuSpeed& a, const CpuSpeed& b) { return a.ms < b.ms; });
  return slowest->ms / fastest->ms;
}

std::string describe(const std::vector<CpuSpeed>& speeds) {
  if (speeds.empty()) return "not measured";
  std::ostringstream s;
  s << std::setprecision(3);
  for (const CpuSpeed& c : speeds)
    s << (&c == &speeds.front() ? "" : ", ") << "cpu" << c.cpu << " " << c.ms << " ms";
  if (speeds.size() > 1)
    s << std::fixed << std::setprecision(2) << " (the slowest " << spread(speeds)
      << "x the fastest)";
  return s.str();
}

}  // namespace gradagg::bench
