// Resources: a segment too large for the address space is a clean error; a long
// soak and a churn of aggregators (some with a killed worker) leave memory, file
// descriptors, threads and /dev/shm as they found them.
#include <dirent.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <system_error>

#include "support/support.h"

namespace gradagg_test {
namespace {

long vmSizeKb() {
  std::ifstream f("/proc/self/status");
  std::string key;
  long value = 0;
  while (f >> key) {
    if (key == "VmSize:") {
      f >> value;
      return value;
    }
    f.ignore(1 << 20, '\n');
  }
  return 0;
}

TEST_F(GradaggTest, SegmentThatDoesNotFitIsACleanErrorAtConstruction) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 1;
    try {
      struct Big : torch::nn::Module {
        Big() { w = register_parameter("w", torch::zeros({8 << 20})); }  // 32 MiB
        torch::Tensor w;
      } model;
      rlimit lim{};
      lim.rlim_cur = lim.rlim_max = static_cast<rlim_t>(vmSizeKb() + 512 * 1024) * 1024;
      ::setrlimit(RLIMIT_AS, &lim);
      gradagg::Options o;
      o.workers = 64;  // 66 copies of 32 MiB: 2 GiB, beyond the limit
      gradagg::Aggregator agg(
          model, [](const gradagg::ShardContext&) { return gradagg::ShardResult{}; }, o);
    } catch (const std::system_error& e) {
      code = std::string(e.what()).find("gradagg") != std::string::npos ? 0 : 2;
    } catch (...) {
      code = 3;
    }
    ::_exit(code);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

int countEntries(const std::string& dir) {
  int n = 0;
  if (auto* d = opendir(dir.c_str())) {
    while (auto* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

long rssKb(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/statm");
  long size = 0, resident = 0;
  f >> size >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

int envInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

TEST_F(GradaggTest, SoakKeepsMemoryDescriptorsAndThreadsFlat) {
  const int steps = envInt("GRADAGG_SOAK_STEPS", 10000);
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 16, torch::kFloat);
  torch::optim::SGD sgd(model->parameters(), 0.01);
  gradagg::Options o;
  o.workers = 2;
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(16, 2, false)), o);
  auto run = [&](int n) {
    for (int s = 0; s < n; ++s) {
      agg.step();
      sgd.step();
    }
  };
  run(200);  // warm-up: allocator caches settle
  const long rss0 = rssKb(getpid());
  std::vector<long> worker_rss0;
  for (int pid : agg.workerPids()) worker_rss0.push_back(rssKb(pid));
  const int fds0 = countEntries("/proc/self/fd"), threads0 = countEntries("/proc/self/task");
  run(steps);
#ifndef __SANITIZE_ADDRESS__  // ASan's quarantine keeps freed memory resident on purpose
  EXPECT_LT(rssKb(getpid()) - rss0, 4096) << "parent RSS grew over " << steps << " steps";
  for (size_t r = 0; r < worker_rss0.size(); ++r)
    EXPECT_LT(rssKb(agg.workerPids()[r]) - worker_rss0[r], 4096) << "worker " << r << " RSS grew";
#endif
  EXPECT_EQ(countEntries("/proc/self/fd"), fds0);
  EXPECT_EQ(countEntries("/proc/self/task"), threads0);
  EXPECT_EQ(agg.stepsDone(), steps + 200);
}

TEST_F(GradaggTest, ChurnOfCreateDestroyAndKillsLeavesNothingBehind) {
  const int cycles = envInt("GRADAGG_CHURN_CYCLES", 100);
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 6, torch::kFloat);
  const int fds0 = countEntries("/proc/self/fd"), shm0 = countEntries("/dev/shm");
  std::mt19937 rng(5);
  int kills = 0;
  for (int c = 0; c < cycles; ++c) {
    gradagg::Options o;
    o.workers = 1 + c % 3;
    gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(6, o.workers, false)), o);
    agg.step();
    if (c % 5 == 2) {  // one cycle in five: SIGKILL a random worker
      const auto pids = agg.workerPids();
      ::kill(pids[rng() % pids.size()], SIGKILL);
      EXPECT_THROW(agg.step(), gradagg::WorkerDied);
      ++kills;
    } else {
      agg.step();
    }
  }
  EXPECT_EQ(kills, cycles / 5);
  EXPECT_TRUE(childPids().empty());
  EXPECT_EQ(countEntries("/proc/self/fd"), fds0);
  EXPECT_EQ(countEntries("/dev/shm"), shm0);
}

}  // namespace
}  // namespace gradagg_test
