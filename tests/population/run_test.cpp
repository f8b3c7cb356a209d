// Populations of real members: what a copy carries, the lineage log,
// checkpoint/resume, ready interval and resampling, and members that die, throw or
// hang (named errors, restarts from the latest snapshot).
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include <gradagg/checkpoint.h>

#include "runtime/temp_dir.h"
#include "runtime/test_seam.h"
#include "support/expect_throws.h"
#include "support/support.h"

namespace {

using gradagg::DecisionRng;
using gradagg::Hyperparams;
using gradagg::Policy;
using gradagg::PolicyInput;
using gradagg_test::expectThrows;

// y = x W^T + b on fixed data; member r trains on rows picked by (rank, step).
struct Fixture {
  torch::nn::Linear net{torch::nn::LinearOptions(6, 3)};
  torch::Tensor x = torch::sin(torch::arange(0, 64 * 6, torch::kFloat).reshape({64, 6}));
  torch::Tensor y = torch::cos(torch::arange(0, 64 * 3, torch::kFloat).reshape({64, 3}));

  gradagg::PopulationFns fns() {
    gradagg::PopulationFns f;
    f.make_optimizer = [](torch::nn::Module& m, const Hyperparams& hp) {
      return std::make_unique<torch::optim::SGD>(
          m.parameters(), torch::optim::SGDOptions(hp.at("lr")).momentum(hp.at("momentum")));
    };
    // Every hyperparameter the optimizer uses must be applied: a resumed member's
    // optimizer is made from its checkpointed hyperparameters.
    f.apply_hyperparams = [](torch::optim::Optimizer& opt, const Hyperparams& hp) {
      for (auto& g : opt.param_groups()) {
        auto& o = static_cast<torch::optim::SGDOptions&>(g.options());
        o.lr(hp.at("lr")).momentum(hp.at("momentum"));
      }
    };
    f.hyperparams = [](int rank, DecisionRng& rng) {
      return Hyperparams{{"lr", 0.01 * (rank + 1) * (0.5 + rng.uniform())}, {"momentum", 0.9}};
    };
    f.train_step = [this](const gradagg::MemberContext& c) {
      const auto rows =
          torch::arange((c.step * 8 + c.rank * 3) % 56, (c.step * 8 + c.rank * 3) % 56 + 8);
      c.optimizer->zero_grad();
      torch::mse_loss(net->forward(x.index_select(0, rows)), y.index_select(0, rows)).backward();
      c.optimizer->step();
    };
    f.score = [this](const gradagg::MemberContext&) {
      torch::NoGradGuard g;
      return torch::mse_loss(net->forward(x), y).item<double>();
    };
    f.init_weights = [](int, torch::nn::Module& m, DecisionRng& rng) {
      torch::NoGradGuard g;
      for (auto& p : m.parameters())
        for (int64_t i = 0; i < p.numel(); ++i) p.view({-1})[i] = rng.uniform() - 0.5;
    };
    return f;
  }
};

gradagg::PopulationOptions options(Policy policy) {
  gradagg::PopulationOptions o;
  o.workers = 4;
  o.publish_interval = 5;
  o.seed = 42;
  o.policy = std::move(policy);
  o.optimizer_state_bytes = 64 << 10;
  o.step_timeout = std::chrono::seconds(60);
  return o;
}

// Rank 1 always copies rank 0.
Policy oneCopiesZero() {
  return Policy::custom("1<-0",
                        [](const PolicyInput& in, DecisionRng&) { return in.rank == 1 ? 0 : -1; });
}

void expectEqual(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                 const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t k = 0; k < a.size(); ++k)
    EXPECT_TRUE(torch::equal(a[k], b[k])) << what << " tensor " << k;
}

// The momentum buffers (loaded into a fresh optimizer) and the lr saved in serialized SGD state.
std::pair<std::vector<torch::Tensor>, double> sgdState(const std::string& bytes) {
  torch::nn::Linear net(6, 3);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(1).momentum(0.9));
  std::istringstream is(bytes);
  torch::serialize::InputArchive a;
  a.load_from(is);
  opt.load(a);
  torch::serialize::InputArchive groups, group, group_options;
  a.read("param_groups", groups);
  groups.read("param_groups/0", group);
  group.read("options", group_options);
  c10::IValue lr;
  group_options.read("lr", lr);
  std::vector<torch::Tensor> bufs;
  for (auto& p : net->parameters()) {
    auto& st = static_cast<torch::optim::SGDParamState&>(
        *opt.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
    bufs.push_back(st.momentum_buffer().clone());
  }
  return {bufs, lr.toDouble()};  // the lr saved with the state
}

class PopulationTest : public gradagg_test::GradaggTest,
                       public ::testing::WithParamInterface<std::tuple<bool, bool>> {};

TEST_P(PopulationTest, ACopyCarriesExactlyWhatTheOptionsSay) {
  const auto [copy_state, copy_hp] = GetParam();
  Fixture f;
  auto o = options(oneCopiesZero());
  o.copy_optimizer_state = copy_state;
  o.copy_hyperparams = copy_hp;
  o.explore = gradagg::Explore::kPerturb;
  gradagg::Population population(*f.net, f.fns(), o);
  const auto own = population.snapshot(1).hyperparams;
  const auto events = population.generation();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].worker, 1);
  EXPECT_EQ(events[0].donor, 0);
  const auto donor = population.snapshot(0), copied = population.snapshot(1);
  EXPECT_EQ(events[0].donor_version, donor.version);
  expectEqual(copied.parameters, donor.parameters, "weights");
  // Explore multiplies what was taken by 0.8 or 1.2, AFTER the optimizer state was loaded.
  const auto& base = copy_hp ? donor.hyperparams : own;
  for (const auto& [name, v] : base) {
    const double got = copied.hyperparams.at(name);
    EXPECT_TRUE(got == v * 0.8 || got == v * 1.2) << name << " " << got << " from " << v;
  }
  EXPECT_EQ(events[0].before, own);
  EXPECT_EQ(events[0].after, copied.hyperparams);
  const auto [donor_momentum, donor_lr] = sgdState(donor.optimizer_state);
  const auto [momentum, lr] = sgdState(copied.optimizer_state);
  EXPECT_EQ(lr, copied.hyperparams.at("lr"));
  bool same = true;
  for (size_t k = 0; k < momentum.size(); ++k)
    same = same && torch::equal(momentum[k], donor_momentum[k]);
  EXPECT_EQ(same, copy_state);
  population.shutdown();
}
INSTANTIATE_TEST_SUITE_P(Options, PopulationTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

class PopulationRunTest : public gradagg_test::GradaggTest {};

TEST_F(PopulationRunTest, LineageLinesMatchTheCopiesMade) {
  Fixture f;
  const gradagg::detail::TempDir dir("population");
  const std::string path = dir.file("lineage.jsonl");
  auto o = options(Policy::random(0.5));
  o.lineage_path = path;
  std::vector<gradagg::CopyEvent> all;
  {
    gradagg::Population population(*f.net, f.fns(), o);
    for (int g = 0; g < 4; ++g) {
      for (auto& e : population.generation()) {
        EXPECT_EQ(population.snapshot(e.worker).hyperparams, e.after);
        all.push_back(e);
      }
    }
  }
  ASSERT_GE(all.size(), 3u);
  std::ifstream in(path);
  std::string line;
  size_t i = 0;
  for (; std::getline(in, line); ++i) {
    ASSERT_LT(i, all.size());
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j.at("step").get<int64_t>(), all[i].step);
    EXPECT_EQ(j.at("worker").get<int>(), all[i].worker);
    EXPECT_EQ(j.at("donor").get<int>(), all[i].donor);
    EXPECT_EQ(j.at("donor_version").get<uint64_t>(), all[i].donor_version);
    EXPECT_EQ(j.at("score").get<double>(), all[i].score);
    EXPECT_EQ(j.at("donor_score").get<double>(), all[i].donor_score);
    EXPECT_EQ(j.at("hyperparams_before").get<Hyperparams>(), all[i].before);
    EXPECT_EQ(j.at("hyperparams_after").get<Hyperparams>(), all[i].after);
  }
  EXPECT_EQ(i, all.size());
}

TEST_F(PopulationRunTest, ResumingFromACheckpointEqualsAnUninterruptedRun) {
  const gradagg::detail::TempDir dir("population");
  const std::string path = dir.file("checkpoint.pt");
  auto o = options(Policy::random(0.5));
  std::vector<gradagg::MemberSnapshot> want, got;
  {
    Fixture f;
    gradagg::Population population(*f.net, f.fns(), o);
    for (int g = 0; g < 4; ++g) population.generation();
    for (int r = 0; r < 4; ++r) want.push_back(population.snapshot(r));
  }
  {
    Fixture f;
    gradagg::Population population(*f.net, f.fns(), o);
    for (int g = 0; g < 2; ++g) population.generation();
    population.checkpoint(path);
  }
  {
    Fixture f;
    auto resumed = o;
    resumed.resume_from = path;
    gradagg::Population population(*f.net, f.fns(), resumed);
    for (int g = 0; g < 2; ++g) population.generation();
    for (int r = 0; r < 4; ++r) got.push_back(population.snapshot(r));
  }
  for (int r = 0; r < 4; ++r) {
    const std::string who = "member " + std::to_string(r);
    expectEqual(got[r].parameters, want[r].parameters, who);
    EXPECT_EQ(got[r].hyperparams, want[r].hyperparams) << who;
    EXPECT_EQ(got[r].score, want[r].score) << who;
    EXPECT_EQ(got[r].step, want[r].step) << who;
    EXPECT_EQ(got[r].last_copy_step, want[r].last_copy_step) << who;
    EXPECT_EQ(sgdState(got[r].optimizer_state).first.size(), 2u);
    expectEqual(sgdState(got[r].optimizer_state).first, sgdState(want[r].optimizer_state).first,
                who + " momentum");
  }
}

TEST_F(PopulationRunTest, AModelCheckpointGivenAsResumeFromIsRefusedNamingTheFile) {
  const gradagg::detail::TempDir dir("population");
  const std::string path = dir.file("model.ckpt");
  {
    Fixture f;
    torch::optim::SGD sgd(f.net->parameters(), 0.1);
    gradagg::Checkpoint(path).save(*f.net, sgd, gradagg::TrainingState{});
  }
  Fixture f;
  auto o = options(Policy::none());
  o.resume_from = path;
  if (const auto e = expectThrows<gradagg::CheckpointError>(
          [&] { gradagg::Population population(*f.net, f.fns(), o); },
          "is not a population checkpoint")) {
    EXPECT_EQ(e->path(), path);
  }
}

TEST_F(PopulationRunTest, AMemberKilledMidPublishRaisesWorkerDiedAndItsLastSnapshotStaysWhole) {
  Fixture f;
  auto o = options(Policy::none());
  // Version 1 is the start, 2 generation 0; die halfway through writing 3.
  gradagg::detail::ScopedTestHooks hooks;
  hooks->on_publish_midway = [](int rank, std::uint64_t version) {
    if (rank == 1 && version == 3) ::raise(SIGKILL);
  };
  gradagg::Population population(*f.net, f.fns(), o);
  population.generation();
  const auto before = population.snapshot(1);
  ASSERT_EQ(before.version, 2u);
  if (const auto e = expectThrows<gradagg::WorkerDied>([&] { population.generation(); },
                                                       "publishing its snapshot")) {
    EXPECT_EQ(e->rank(), 1);
    EXPECT_EQ(e->phase(), gradagg::Phase::kPublishing);
    EXPECT_EQ(e->signal(), SIGKILL);
  }
  EXPECT_FALSE(population.usable());
  const auto after = population.snapshot(1);
  EXPECT_EQ(after.version, 2u);
  expectEqual(after.parameters, before.parameters, "member 1 after its death");
  EXPECT_THROW(population.generation(), gradagg::NotUsable);
}

TEST_F(PopulationRunTest, AMemberKilledBetweenGenerationsIsNamed) {
  Fixture f;
  gradagg::Population population(*f.net, f.fns(), options(Policy::tournament()));
  population.generation();
  ::kill(population.workerPids()[2], SIGKILL);
  if (const auto e = expectThrows<gradagg::WorkerDied>([&] { population.generation(); })) {
    EXPECT_EQ(e->rank(), 2);
  }
}

TEST_F(PopulationRunTest, AThrowingTrainStepIsWorkerFailedWithItsMessage) {
  Fixture f;
  auto fns = f.fns();
  fns.train_step = [](const gradagg::MemberContext& c) {
    if (c.rank == 3 && c.step == 2) throw std::runtime_error("bad batch");
  };
  gradagg::Population population(*f.net, fns, options(Policy::none()));
  if (const auto e = expectThrows<gradagg::WorkerFailed>([&] { population.generation(); })) {
    EXPECT_EQ(e->rank(), 3);
    EXPECT_EQ(e->message(), "bad batch");
  }
}

TEST_F(PopulationRunTest, ReadyIntervalSpacesCopiesAndResampleSetsTheNewValues) {
  Fixture f;
  auto o = options(oneCopiesZero());
  o.ready_interval = 10;  // two generations of 5 steps
  o.explore = gradagg::Explore::kResample;
  o.resample = [](const Hyperparams& hp, DecisionRng&) {
    Hyperparams next = hp;
    next["lr"] = 0.125;
    return next;
  };
  gradagg::Population population(*f.net, f.fns(), o);
  std::vector<int64_t> steps;
  for (int g = 0; g < 4; ++g) {
    for (const auto& e : population.generation()) {
      steps.push_back(e.step);
      EXPECT_EQ(e.after.at("lr"), 0.125);
      EXPECT_EQ(e.after.at("momentum"), e.before.at("momentum"));  // copied: both 0.9
    }
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{10, 20}));
  EXPECT_EQ(population.snapshot(1).last_copy_step, 20);
  EXPECT_EQ(population.snapshot(1).hyperparams.at("lr"), 0.125);
}

TEST_F(PopulationRunTest, MaxRestartsForksADeadMemberAgainFromItsLatestSnapshot) {
  Fixture f;
  // Shared with the members: the hook kills rank 1 halfway through its first
  // publish of version 3, once.
  auto* killed = static_cast<std::atomic<int>*>(
      ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(killed, MAP_FAILED);
  killed->store(0);
  auto o = options(Policy::none());  // versions: 1 start, 2 generation 0, 3 generation 1
  o.max_restarts = 2;
  gradagg::detail::ScopedTestHooks hooks;
  hooks->on_publish_midway = [killed](int rank, std::uint64_t version) {
    if (rank == 1 && version == 3 && killed->exchange(1) == 0) ::raise(SIGKILL);
  };
  {
    gradagg::Population population(*f.net, f.fns(), o);
    population.generation();
    population.generation();  // rank 1 dies publishing, restarts from version 2 (step 5)
    EXPECT_EQ(population.restarts(), 1);
    EXPECT_EQ(population.snapshot(1).step, 5);  // lost generation 1's steps
    EXPECT_EQ(population.snapshot(0).step, 10);
    ::kill(population.workerPids()[2], SIGKILL);  // idle: restarted at the next generation
    population.generation();
    EXPECT_EQ(population.restarts(), 2);
    EXPECT_TRUE(population.usable());
    for (int r = 0; r < 4; ++r)
      EXPECT_TRUE(torch::isfinite(population.snapshot(r).parameters[0]).all().item<bool>());
    ::kill(population.workerPids()[0], SIGKILL);  // no restarts left
    EXPECT_THROW(population.generation(), gradagg::WorkerDied);
  }
  ::munmap(killed, 4096);
}

TEST_F(PopulationRunTest, AHangingMemberIsAStepTimeoutNamingIt) {
  Fixture f;
  auto fns = f.fns();
  fns.train_step = [](const gradagg::MemberContext& c) {
    if (c.rank == 2) std::this_thread::sleep_for(std::chrono::seconds(30));
  };
  auto o = options(Policy::none());
  o.step_timeout = std::chrono::milliseconds(500);
  gradagg::Population population(*f.net, fns, o);
  const auto t0 = std::chrono::steady_clock::now();
  if (const auto e = expectThrows<gradagg::StepTimeout>([&] { population.generation(); })) {
    EXPECT_EQ(e->rank(), 2);
    EXPECT_EQ(e->phase(), gradagg::Phase::kTraining);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_FALSE(population.usable());
}

}  // namespace
