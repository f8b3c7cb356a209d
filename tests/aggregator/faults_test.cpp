// Faults: a worker killed in each phase, restarts, a killed parent, a stopped
// worker, non-finite gradients, bad input, resources, soak and churn.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <dirent.h>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "core/test_seam.h"
#include "support/expect_throws.h"
#include "support/support.h"

namespace gradagg_test {
namespace {

using namespace std::chrono_literals;
using gradagg::Phase;

std::string serialize(torch::optim::Optimizer& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}

std::vector<torch::Tensor> paramsOf(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

bool bitIdentical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k)
    if (!torch::equal(a[k], b[k])) return false;
  return true;
}

// A flag in memory shared with every worker generation (they are forked later).
struct SharedFlag {
  SharedFlag() {
    p = static_cast<std::atomic<int>*>(
        mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    p->store(0);
  }
  ~SharedFlag() { munmap(p, 4096); }
  std::atomic<int>* p;
};

class KilledInPhase : public GradaggTest, public ::testing::WithParamInterface<Phase> {};

TEST_P(KilledInPhase, RaisesWorkerDiedWithinASecondAndChangesNothing) {
  const Phase target = GetParam();
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 12, torch::kFloat);
  torch::optim::Adam adam(model->parameters(), 0.01);
  gradagg::Options o;
  o.workers = 3;
  gradagg::detail::ScopedTestHooks hooks;
  hooks->on_worker_phase = [target](int rank, Phase phase, int64_t step) {
    if (rank == 1 && phase == target && step == 1) ::raise(SIGKILL);
  };
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(12, 3, false)), o);
  agg.step();
  adam.step();
  const auto params = paramsOf(*model);
  const auto grads = gradsOf(*model);
  const std::string state = serialize(adam);
  if (target == Phase::kWaiting) ::kill(agg.workerPids()[1], SIGKILL);  // killed while idle

  const auto t0 = std::chrono::steady_clock::now();
  if (const auto e = expectThrows<gradagg::WorkerDied>([&] { agg.step(); },
                                                      gradagg::phaseName(target))) {
    EXPECT_EQ(e->rank(), 1);
    EXPECT_EQ(e->phase(), target) << e->what();
    EXPECT_EQ(e->signal(), SIGKILL);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_TRUE(bitIdentical(paramsOf(*model), params)) << "parameters changed";
  expectClose(gradsOf(*model), grads, 0, ".grad after the failed step");
  EXPECT_EQ(serialize(adam), state) << "optimizer state changed";
  EXPECT_TRUE(childPids().empty()) << "the other workers were not reaped";
  EXPECT_THROW(agg.step(), gradagg::NotUsable);
}

INSTANTIATE_TEST_SUITE_P(Phases, KilledInPhase,
                         ::testing::Values(Phase::kWaiting, Phase::kLoadingSnapshot, Phase::kShard,
                                           Phase::kBackward, Phase::kWritingSlot, Phase::kReducing),
                         [](const auto& info) {
                           std::string name = gradagg::phaseName(info.param);
                           std::string out;
                           bool up = true;
                           for (char c : name) {
                             if (c == ' ' || c == '\'') {
                               up = true;
                               continue;
                             }
                             out += up ? static_cast<char>(std::toupper(c)) : c;
                             up = false;
                           }
                           return out;
                         });

std::vector<torch::Tensor> trainWithFault(bool fault, int* restarts) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 18, torch::kFloat);
  torch::optim::Adam adam(model->parameters(), 0.01);
  SharedFlag fired;
  gradagg::Options o;
  o.workers = 3;
  o.max_restarts = 2;
  gradagg::detail::ScopedTestHooks hooks;
  if (fault) {
    hooks->on_worker_phase = [&fired](int rank, Phase phase, int64_t step) {
      if (rank == 2 && phase == Phase::kBackward && step == 3 && fired.p->exchange(1) == 0)
        ::raise(SIGKILL);
    };
  }
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(18, 3, true)), o);
  for (int s = 0; s < 6; ++s) {
    *restarts = agg.step().restarts;
    adam.step();
  }
  return paramsOf(*model);
}

TEST_F(GradaggTest, MaxRestartsRedoesTheStepAndTrainingMatchesAnUnfaultedRun) {
  int restarts_clean = -1, restarts_faulted = -1;
  const auto clean = trainWithFault(false, &restarts_clean);
  const auto faulted = trainWithFault(true, &restarts_faulted);
  EXPECT_EQ(restarts_clean, 0);
  EXPECT_EQ(restarts_faulted, 1);
  EXPECT_TRUE(bitIdentical(clean, faulted));
}

TEST_F(GradaggTest, RestartsRunOutThenTheErrorIsRaised) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Options o;
  o.workers = 2;
  o.max_restarts = 2;
  gradagg::detail::ScopedTestHooks hooks;
  hooks->on_worker_phase = [](int rank, Phase phase, int64_t) {
    if (rank == 0 && phase == Phase::kShard) ::raise(SIGKILL);  // every generation
  };
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(4, 2, false)), o);
  EXPECT_THROW(agg.step(), gradagg::WorkerDied);
  EXPECT_FALSE(agg.usable());
}

// The state letter of /proc/<pid>/stat (R, S, T, Z, ...), or 0 when there is none.
char procState(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return 0;
  const auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() ? line[close + 2] : 0;
}

bool gone(pid_t pid) {
  const char state = procState(pid);
  return state == 0 || state == 'Z' || state == 'X';
}

TEST_F(GradaggTest, KilledParentTakesEveryWorkerWithItWithinASecond) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t middle = ::fork();
  ASSERT_GE(middle, 0);
  if (middle == 0) {
    // The training process: a step that lasts long, so workers are busy when it dies.
    ::close(fds[0]);
    try {
      auto model = makeModel(ModelKind::kLinear, torch::kFloat);
      const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
      gradagg::Options o;
      o.workers = 3;
      gradagg::Aggregator agg(*model, [&](const gradagg::ShardContext& c) {
        if (c.rank != 0) std::this_thread::sleep_for(60s);  // rank 0 idles in the barrier
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
      }, o);
      const auto pids = agg.workerPids();
      ::write(fds[1], pids.data(), pids.size() * sizeof(int));
      ::close(fds[1]);
      agg.step();
    } catch (...) {
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  int pids[3];
  ASSERT_EQ(::read(fds[0], pids, sizeof(pids)), static_cast<ssize_t>(sizeof(pids)));
  ::close(fds[0]);
  std::this_thread::sleep_for(200ms);  // into the step
  ::kill(middle, SIGKILL);
  int status;
  ::waitpid(middle, &status, 0);
  const auto t0 = std::chrono::steady_clock::now();
  for (int pid : pids) {
    while (!gone(pid) && std::chrono::steady_clock::now() - t0 < 5s)
      std::this_thread::sleep_for(5ms);
    EXPECT_TRUE(gone(pid)) << "worker " << pid << " outlived its parent";
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
}

TEST_F(GradaggTest, StoppedWorkerMissesTheDeadlineAndIsNamed) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Options o;
  o.workers = 3;
  o.step_timeout = 300ms;
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(4, 3, false)), o);
  agg.step();
  const pid_t victim = agg.workerPids()[2];
  ::kill(victim, SIGSTOP);
  while (procState(victim) != 'T') std::this_thread::sleep_for(1ms);  // stopped while waiting
  const auto t0 = std::chrono::steady_clock::now();
  if (const auto e = expectThrows<gradagg::StepTimeout>([&] { agg.step(); }, "300 ms")) {
    EXPECT_EQ(e->rank(), 2);
    EXPECT_EQ(e->phase(), Phase::kWaiting);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_TRUE(childPids().empty());
}

gradagg::ShardFn poisonAt(TestModel& model, const Data& data, int rank, std::set<int64_t> steps) {
  auto inner = shardFn(model, data, shardBounds(data.x.size(0), 2, false));
  return [=](const gradagg::ShardContext& c) {
    auto r = inner(c);
    if (c.rank == rank && steps.count(c.step)) r.loss = r.loss * std::nan("");
    return r;
  };
}

TEST_F(GradaggTest, NonFiniteGradientRaisesNamingRankAndParameterByDefault) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Options o;
  o.workers = 2;
  gradagg::Aggregator agg(*model, poisonAt(*model, data, 1, {1}), o);
  agg.step();
  const auto params = paramsOf(*model);
  const auto grads = gradsOf(*model);
  if (const auto e = expectThrows<gradagg::NonFiniteGradient>([&] { agg.step(); }, "'theta'")) {
    EXPECT_EQ(e->rank(), 1);
    EXPECT_EQ(e->parameter(), "theta") << e->what();
  }
  EXPECT_TRUE(bitIdentical(paramsOf(*model), params));
  expectClose(gradsOf(*model), grads, 0, ".grad after the refused step");
  EXPECT_TRUE(agg.usable());
}

TEST_F(GradaggTest, NonFiniteGradientSkipsTheStepThenAbortsAfterTooManyInARow) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  gradagg::Options o;
  o.workers = 2;
  o.non_finite = gradagg::NonFinitePolicy::kSkipStep;
  o.max_consecutive_skips = 2;
  gradagg::Aggregator agg(*model, poisonAt(*model, data, 0, {1, 3, 4, 5}), o);
  EXPECT_FALSE(agg.step().skipped);  // step 0
  sgd.step();
  auto params = paramsOf(*model);
  const auto& r1 = agg.step();  // step 1: skipped
  EXPECT_TRUE(r1.skipped);
  EXPECT_EQ(r1.consecutive_skips, 1);
  for (auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
  sgd.step();
  EXPECT_TRUE(bitIdentical(paramsOf(*model), params)) << "a skipped step changed parameters";
  EXPECT_FALSE(agg.step().skipped);  // step 2
  sgd.step();
  EXPECT_TRUE(agg.step().skipped);   // 3
  EXPECT_EQ(agg.step().consecutive_skips, 2);  // 4
  EXPECT_THROW(agg.step(), gradagg::NonFiniteGradient);  // 5: a third in a row
  EXPECT_EQ(agg.stepsDone(), 5);
}

TEST_F(GradaggTest, SparseGradientsMatchSingleProcessAutograd) {
  struct Emb : torch::nn::Module {
    Emb() {
      emb = register_module("emb", torch::nn::Embedding(
                                       torch::nn::EmbeddingOptions(20, 4).sparse(true)));
    }
    torch::nn::Embedding emb{nullptr};
  };
  torch::manual_seed(3);
  Emb model, ref;
  {
    torch::NoGradGuard g;
    ref.emb->weight.copy_(model.emb->weight);
  }
  const auto idx = torch::randint(0, 20, {12}, torch::kLong);
  ref.emb(idx).pow(2).mean().backward();
  gradagg::Options o;
  o.workers = 3;
  gradagg::Aggregator agg(model, [&](const gradagg::ShardContext& c) {
    return gradagg::ShardResult{model.emb(idx.slice(0, 4 * c.rank, 4 * c.rank + 4)).pow(2).mean(),
                                4};
  }, o);
  agg.step();
  EXPECT_LE(relErr(model.emb->weight.grad(), ref.emb->weight.grad().to_dense()), 1e-6);
}

TEST_F(GradaggTest, NonContiguousParameterIsServedContiguouslyAndMatches) {
  struct T : torch::nn::Module {
    T() { w = register_parameter("w", torch::randn({4, 3}, torch::kDouble).t()); }
    torch::Tensor w;
  } model;
  ASSERT_FALSE(model.w.is_contiguous());
  const auto x = torch::randn({6, 4}, torch::kDouble);
  auto ref_w = model.w.detach().clone().requires_grad_(true);
  x.mm(ref_w.t()).pow(2).mean().backward();
  gradagg::Options o;
  o.workers = 2;
  gradagg::Aggregator agg(model, [&](const gradagg::ShardContext& c) {
    return gradagg::ShardResult{x.slice(0, 3 * c.rank, 3 * c.rank + 3).mm(model.w.t()).pow(2).mean(),
                                3};
  }, o);
  agg.step();
  EXPECT_LE(relErr(model.w.grad(), ref_w.grad()), 1e-12);
}

TEST_F(GradaggTest, ParameterAddedAfterConstructionIsAnInvalidArgument) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(4, 2, false)), {});
  agg.step();
  model->register_parameter("extra", torch::zeros({3}));
  expectThrows<gradagg::InvalidArgument>([&] { agg.step(); }, "parameter list changed");
  EXPECT_TRUE(agg.usable());
}

TEST_F(GradaggTest, CudaModelIsRefusedWithAClearError) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  model->to(torch::kCUDA);
  EXPECT_THROW(gradagg::Aggregator(*model, [](const gradagg::ShardContext&) {
    return gradagg::ShardResult{};
  }), gradagg::InvalidArgument);
}

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
      gradagg::Aggregator agg(model, [](const gradagg::ShardContext&) {
        return gradagg::ShardResult{};
      }, o);
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
