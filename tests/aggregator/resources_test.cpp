// Resources: a segment too large for the address space is a clean error; a long
// soak and a churn of aggregators (some with a killed worker) leave memory, file
// descriptors, threads and /dev/shm as they found them; workers keep the memory
// a step frees for the next one (Options::keep_worker_memory).
#include <dirent.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
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

// Minor page faults of allocating, touching and freeing an 8 MiB temporary, over
// the last 4 of 16 times: what a step's activations cost in the steady state when
// their memory is mapped and faulted in again each time. (glibc's first kept
// chunks do not fit the next 64-byte aligned request of the same size, and the
// tensor's small objects between them stay in its per-thread cache: the heap
// grows for a few rounds before it serves one from freed memory.)
double faultsOfTemporaries() {
  const auto touch = [] { torch::empty({2 << 20}).fill_(1.0f); };
  for (int k = 0; k < 12; ++k) touch();
  rusage before{};
  ::getrusage(RUSAGE_SELF, &before);
  for (int k = 0; k < 4; ++k) touch();
  rusage after{};
  ::getrusage(RUSAGE_SELF, &after);
  return static_cast<double>(after.ru_minflt - before.ru_minflt);
}

// In a child whose malloc maps every chunk from 128 KiB up (the threshold a
// process starts with, made fixed here, so the test does not depend on what this
// process freed before): the worker's faults over its last 8 MiB temporaries.
double workerFaultsAfterAParentWithGlibcDefaults(bool keep_worker_memory) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(pipe_fds[0]);
    double faults = -2;
    try {
      ::mallopt(M_MMAP_THRESHOLD, 128 << 10);
      auto model = makeModel(ModelKind::kLinear, torch::kFloat);
      const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
      const gradagg::ShardFn shard = shardFn(*model, data, {0, 4});
      gradagg::Options o;
      o.workers = 1;
      o.keep_worker_memory = keep_worker_memory;
      gradagg::Aggregator agg(
          *model,
          [&](const gradagg::ShardContext& c) {
            gradagg::ShardResult r = shard(c);
            r.metrics = {{"faults", faultsOfTemporaries()}};
            return r;
          },
          o);
      faults = agg.step().workers.at(0).metrics.at("faults");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
    const bool ok = ::write(pipe_fds[1], &faults, sizeof faults) == sizeof faults;
    ::_exit(ok ? 0 : 1);
  }
  ::close(pipe_fds[1]);
  double faults = -3;
  if (pid < 0 || ::read(pipe_fds[0], &faults, sizeof faults) != sizeof faults) faults = -4;
  ::close(pipe_fds[0]);
  if (pid > 0) ::waitpid(pid, nullptr, 0);
  return faults;
}

TEST_F(GradaggTest, WorkersKeepTheMemoryAStepFreesForTheNextStep) {
#ifdef __SANITIZE_ADDRESS__
  GTEST_SKIP() << "ASan's allocator replaces glibc's malloc and its settings";
#else
  // 4 x 8 MiB is 8192 pages: mapped anew each time, every page faults; kept, none.
  const double kept = workerFaultsAfterAParentWithGlibcDefaults(true);
  const double mapped = workerFaultsAfterAParentWithGlibcDefaults(false);
  EXPECT_GE(kept, 0);
  EXPECT_LT(kept, 256) << "a worker faulted its freed temporaries in again";
  EXPECT_GE(mapped, 8000) << "without keep_worker_memory the worker should inherit the "
                             "parent's malloc settings (the test's control)";
#endif
}

// Entries of `dir`, without those a concurrent test's Python process makes in
// /dev/shm (a DataLoader's "torch_<pid>_...", multiprocessing's semaphores
// "sem.*"); gradagg's segments are anonymous and have no name.
int countEntries(const std::string& dir) {
  int n = 0;
  if (auto* d = opendir(dir.c_str())) {
    while (auto* e = readdir(d)) {
      const std::string name = e->d_name;
      n += name[0] != '.' && name.rfind("torch_", 0) != 0 && name.rfind("sem.", 0) != 0;
    }
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
