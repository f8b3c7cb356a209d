// The global step (Options::start_step): the first step() computes step
// start_step, the workers' seeds follow it, and a run resumed from a checkpoint
// in a fresh process ends bit for bit where the run that was never stopped
// ends (dropout masks, batches and Adam's state included).
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gradagg/checkpoint.h>

#include "behaviour.h"

extern char** environ;

namespace gradagg_test {
namespace {

TEST_F(Behaviour, TheFirstStepIsStartStepAndTheReportCountsOn) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  auto o = opts(2);
  o.start_step = 40;
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), c.step + 1};
      },
      o);
  EXPECT_EQ(agg.stepsDone(), 40);
  for (int64_t s = 40; s < 43; ++s) {
    const auto& report = agg.step();
    EXPECT_EQ(report.step, s);
    for (const auto& w : report.workers) EXPECT_EQ(w.samples, s + 1) << "ctx.step";
  }
  EXPECT_EQ(agg.stepsDone(), 43);
}

TEST_F(Behaviour, ANegativeStartStepIsAnInvalidArgumentNamingTheField) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  auto o = opts(1);
  o.start_step = -1;
  try {
    gradagg::Aggregator agg(
        *model, [](const gradagg::ShardContext&) { return gradagg::ShardResult{}; }, o);
    ADD_FAILURE() << "no error";
  } catch (const gradagg::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("start_step"), std::string::npos) << e.what();
  }
}

// --- resume in a fresh process ----------------------------------------------------------

struct DropoutNet : torch::nn::Module {
  DropoutNet() {
    torch::manual_seed(5);
    a = register_module("a", torch::nn::Linear(6, 24));
    drop = register_module("drop", torch::nn::Dropout(0.5));
    b = register_module("b", torch::nn::Linear(24, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(drop(torch::relu(a(x)))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::nn::Dropout drop{nullptr};
};

constexpr int kRows = 48, kBatch = 12, kSteps = 20, kStopAt = 10;

// Deterministic data without the generator: the run's random draws are the
// workers' dropout masks only.
Data dropoutData() {
  const auto i = torch::arange(kRows * 6, torch::kFloat).reshape({kRows, 6});
  const auto x = torch::sin(i * 0.37);
  return {x, x.sum(1, true).cos()};
}

// Trains steps [from, to) with 3 workers, each step's batch picked by the
// global step, saving `path` after every step. from > 0 resumes from `path`.
void train(const std::string& path, int64_t from, int64_t to) {
  DropoutNet net;
  torch::optim::Adam adam(net.parameters(), 0.01);
  const Data data = dropoutData();
  gradagg::Checkpoint checkpoint(path);
  auto o = opts(3);
  if (from > 0) o.start_step = checkpoint.load(net, adam, {{"rows", "48"}}).step;
  ASSERT_EQ(o.start_step, from);
  gradagg::Aggregator agg(
      net,
      [&](const gradagg::ShardContext& c) {
        const int64_t first = (c.step * kBatch + c.rank * (kBatch / 3)) % kRows;
        const auto rows = torch::arange(first, first + kBatch / 3);
        const auto loss = torch::mse_loss(net.forward(data.x.index_select(0, rows)),
                                          data.y.index_select(0, rows));
        return gradagg::ShardResult{loss, kBatch / 3};
      },
      o);
  for (int64_t s = from; s < to; ++s) {
    agg.step();
    adam.step();
    checkpoint.save(net, adam, gradagg::TrainingState{s + 1, {}, {{"rows", "48"}}, "", {}});
  }
}

constexpr const char* kChildEnv = "GRADAGG_TEST_RESUME_FROM";

// Runs this very test in a new process (the same binary) with kChildEnv set.
int runInFreshProcess(const std::string& path) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter =
      std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name();
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  env_strings.push_back(std::string(kChildEnv) + "=" + path);
  std::vector<char*> env;
  for (auto& s : env_strings) env.push_back(s.data());
  env.push_back(nullptr);
  std::string self = "/proc/self/exe";
  char* argv[] = {self.data(), const_cast<char*>(filter.c_str()), nullptr};
  pid_t pid = 0;
  if (::posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv, env.data()) != 0) return -1;
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST_F(Behaviour, ARunResumedInAFreshProcessIsTheRunNeverStoppedBitForBit) {
  if (const char* path = std::getenv(kChildEnv)) {  // the fresh process: resume
    train(path, kStopAt, kSteps);
    return;
  }
  const auto dir =
      std::filesystem::temp_directory_path() / ("gradagg-resume-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string whole = (dir / "whole.ckpt").string(),
                    resumed = (dir / "resumed.ckpt").string();
  train(whole, 0, kSteps);     // the run never stopped
  train(resumed, 0, kStopAt);  // a run stopped after kStopAt steps...
  ASSERT_EQ(runInFreshProcess(resumed), 0) << "the resumed run failed";  // ...resumed

  DropoutNet a, b;
  torch::optim::Adam adam_a(a.parameters(), 0.01), adam_b(b.parameters(), 0.01);
  using Access = gradagg::Checkpoint::Access;
  EXPECT_EQ(gradagg::Checkpoint(whole, Access::kReadOnly).load(a, adam_a, {{"rows", "48"}}).step,
            kSteps);
  EXPECT_EQ(gradagg::Checkpoint(resumed, Access::kReadOnly).load(b, adam_b, {{"rows", "48"}}).step,
            kSteps);
  EXPECT_TRUE(bitIdentical(paramsOf(a), paramsOf(b)))
      << "the resumed run's parameters after step " << kSteps << " differ";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace gradagg_test
