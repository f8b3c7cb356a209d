// Killed and stopped processes: a worker killed in each phase of a step, restarts
// after a kill, the parent killed mid-step, a worker stopped past the deadline.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <csignal>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "runtime/test_seam.h"
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
  if (const auto e =
          expectThrows<gradagg::WorkerDied>([&] { agg.step(); }, gradagg::phaseName(target))) {
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
                         [](const auto& tested) {
                           std::string name = gradagg::phaseName(tested.param);
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
      gradagg::Aggregator agg(
          *model,
          [&](const gradagg::ShardContext& c) {
            if (c.rank != 0) std::this_thread::sleep_for(60s);  // rank 0 idles in the barrier
            return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
          },
          o);
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
  ownProcessGroup();  // nothing but this test continues the stopped worker
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

// One worker of one thread leaves the parent a core of its own on a machine of
// two or more: it then spins through the step instead of sleeping. A worker
// killed, or stopped, meanwhile is found as soon as with a sleeping parent.
TEST_F(GradaggTest, AParentSpinningOnItsOwnCoreStillSeesItsWorkerDieOrStop) {
  ownProcessGroup();
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kFloat);
  gradagg::Options o;
  o.workers = 1;
  o.threads_per_worker = 1;
  o.step_timeout = 300ms;
  gradagg::detail::ScopedTestHooks hooks;
  hooks->on_worker_phase = [](int, Phase phase, int64_t step) {
    if (phase == Phase::kBackward && step == 2) ::raise(SIGKILL);
  };
  {
    gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(8, 1, false)), o);
    agg.step();
    const auto grads = gradsOf(*model);
    expectClose(grads, fullBatchGrads(*model, data), 1e-6, "one worker's gradient");
    agg.step();
    const auto t0 = std::chrono::steady_clock::now();
    if (const auto e = expectThrows<gradagg::WorkerDied>([&] { agg.step(); }, "backward")) {
      EXPECT_EQ(e->rank(), 0);
      EXPECT_EQ(e->signal(), SIGKILL);
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
    EXPECT_TRUE(childPids().empty());
  }
  hooks->on_worker_phase = nullptr;
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(8, 1, false)), o);
  agg.step();
  const pid_t victim = agg.workerPids()[0];
  ::kill(victim, SIGSTOP);
  while (procState(victim) != 'T') std::this_thread::sleep_for(1ms);
  const auto t0 = std::chrono::steady_clock::now();
  if (const auto e = expectThrows<gradagg::StepTimeout>([&] { agg.step(); }, "300 ms")) {
    EXPECT_EQ(e->rank(), 0);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_TRUE(childPids().empty());
}

}  // namespace
}  // namespace gradagg_test
