// Population mode: seqlock snapshots across processes, the policies' decisions,
// what a copy carries, the lineage log, checkpoint/resume and faults.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "population/layout.h"
#include "core/process.h"
#include "core/segment.h"
#include "core/temp_dir.h"
#include "core/test_seam.h"
#include "support/expect_throws.h"
#include "support/support.h"

namespace {

using gradagg::DecisionRng;
using gradagg::Hyperparams;
using gradagg::Policy;
using gradagg::PolicyInput;
using gradagg_test::expectThrows;
namespace pop = gradagg::detail::pop;

// ---- seqlock snapshots, torch-free, in real processes -------------------------

struct OneMember {
  pop::PopLayout layout;
  gradagg::detail::Segment segment;
  pop::MemberArea area;
  std::size_t floats;
  explicit OneMember(std::size_t n) : floats(n) {
    pop::PopSizes s;
    s.workers = 1;
    s.param_bytes = gradagg::detail::alignUp(n * sizeof(float), 64);
    layout = pop::PopLayout::plan(s, gradagg::detail::pageBytes());
    segment = gradagg::detail::Segment::createAnonymous(layout.segment_bytes);
    area = pop::memberArea(segment.base(), layout, 0);
  }
  void publish(std::uint64_t version, const std::function<void()>& midway = {}) {
    pop::MetaValues m;
    m.version = version;
    m.step = static_cast<std::int64_t>(version) * 10;
    pop::publish(area, m, [&](std::byte* p) {
      auto* f = reinterpret_cast<float*>(p);
      for (std::size_t i = 0; i < floats; ++i) f[i] = static_cast<float>(version);
    }, midway);
  }
  // 0: a consistent copy of a published version; otherwise what was wrong.
  int readAndCheck(std::vector<float>& buf, std::uint64_t* version) {
    pop::MetaValues m;
    const auto all = [&](const pop::MetaValues&) { return layout.sizes.param_bytes; };
    if (!pop::read(area, &m, reinterpret_cast<std::byte*>(buf.data()), all, 1000000)) return 2;
    if (m.step != static_cast<std::int64_t>(m.version) * 10) return 3;
    for (std::size_t i = 0; i < floats; ++i)
      if (buf[i] != static_cast<float>(m.version)) return 4;
    *version = m.version;
    return 0;
  }
};

class PopulationSnapshotTest : public gradagg_test::GradaggTest {};

TEST_F(PopulationSnapshotTest, ReadersInOtherProcessesOnlyEverSeePublishedVersions) {
  OneMember m(1 << 16);  // 256 KiB per snapshot: a copy takes long enough to overlap writes
  m.publish(1);
  // Shared: how many readers are satisfied. The writer publishes until all are.
  auto* satisfied = static_cast<std::atomic<int>*>(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE,
                                                          MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(satisfied, MAP_FAILED);
  satisfied->store(0);
  constexpr int kReaders = 3;
  gradagg::detail::ProcessSet procs;
  procs.spawn([&] {
    std::uint64_t v = 2;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (; satisfied->load() < kReaders; ++v) {
      m.publish(v);
      if (std::chrono::steady_clock::now() > deadline) return 1;
    }
    return 0;
  });
  for (int reader = 0; reader < kReaders; ++reader) {
    procs.spawn([&] {
      std::vector<float> buf(m.layout.sizes.param_bytes / sizeof(float));
      std::uint64_t last = 0, v = 0;
      int reads = 0, versions = 0;
      while (versions < 300) {  // distinct versions seen, each read while the writer ran
        if (int bad = m.readAndCheck(buf, &v)) return 10 + bad;
        if (v < last) return 20;  // versions never go back
        versions += v != last;
        last = v;
        ++reads;
      }
      satisfied->fetch_add(1);
      return 0;
    });
  }
  const bool ended = procs.waitAll(std::chrono::seconds(120));
  ::munmap(satisfied, 4096);
  ASSERT_TRUE(ended) << "deadline";
  for (std::size_t i = 0; i < procs.size(); ++i) {
    auto exit = procs.poll(i);
    ASSERT_TRUE(exit.has_value());
    EXPECT_EQ(exit->exit_status, 0) << "process " << i << " " << exit->describe();
  }
}

TEST_F(PopulationSnapshotTest, AWriterKilledMidPublishLeavesThePreviousVersionReadable) {
  OneMember m(1000);
  m.publish(1);
  m.publish(2);
  gradagg::detail::ProcessSet procs;
  procs.spawn([&] {
    m.publish(3, [] { ::raise(SIGKILL); });
    return 0;
  });
  ASSERT_TRUE(procs.waitAll(std::chrono::seconds(30)));
  EXPECT_EQ(procs.poll(0)->signal, SIGKILL);
  std::vector<float> buf(m.layout.sizes.param_bytes / sizeof(float));
  std::uint64_t v = 0;
  ASSERT_EQ(m.readAndCheck(buf, &v), 0);
  EXPECT_EQ(v, 2u);
  // The next writer recovers the half-written slot.
  m.publish(3);
  m.publish(4);
  m.publish(5);
  ASSERT_EQ(m.readAndCheck(buf, &v), 0);
  EXPECT_EQ(v, 5u);
}

// ---- policies ---------------------------------------------------------------

PolicyInput input(int rank, std::vector<double> scores, bool higher = false) {
  PolicyInput in;
  in.rank = rank;
  in.workers = static_cast<int>(scores.size());
  in.scores = std::move(scores);
  in.higher_is_better = higher;
  return in;
}

TEST(PopulationPolicy, NoneNeverCopies) {
  auto rng = DecisionRng::derive(1, 0, 0, 4);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(Policy::none().chooseDonor(input(0, {1, 0}), rng), -1);
}

TEST(PopulationPolicy, RandomCopiesWithProbabilityPAUniformOtherMember) {
  const Policy p = Policy::random(0.15);
  std::vector<int> donors(4, 0);
  int copies = 0;
  constexpr int kDraws = 40000;
  for (int i = 0; i < kDraws; ++i) {
    auto rng = DecisionRng::derive(7, 2, i, 4);
    const int d = p.chooseDonor(input(2, {0, 0, 0, 0}), rng);
    if (d < 0) continue;
    ASSERT_NE(d, 2);
    ++copies;
    ++donors[static_cast<std::size_t>(d)];
  }
  EXPECT_NEAR(copies / double(kDraws), 0.15, 0.01);
  for (int r : {0, 1, 3}) EXPECT_NEAR(donors[r] / double(copies), 1 / 3.0, 0.03) << r;
  EXPECT_EQ(donors[2], 0);
  // The same (seed, rank, step) gives the same decision.
  for (int i = 0; i < 50; ++i) {
    auto a = DecisionRng::derive(3, 1, i, 4), b = DecisionRng::derive(3, 1, i, 4);
    EXPECT_EQ(p.chooseDonor(input(1, {0, 0, 0}), a), p.chooseDonor(input(1, {0, 0, 0}), b));
  }
  EXPECT_THROW(Policy::random(1.5), gradagg::InvalidArgument);
}

TEST(PopulationPolicy, TruncationBottomCopiesTop) {
  const Policy p = Policy::truncation(0.2);
  // Lower is better: best 1 and 4, worst 2 and 0 (10 members: 2 each side).
  const std::vector<double> s = {9, 0.1, 10, 5, 0.2, 4, 3, 6, 7, 2};
  std::vector<int> donors(10, 0);
  for (int i = 0; i < 2000; ++i) {
    for (int r = 0; r < 10; ++r) {
      auto rng = DecisionRng::derive(5, r, i, 4);
      const int d = p.chooseDonor(input(r, s), rng);
      if (r == 2 || r == 0) {
        ASSERT_TRUE(d == 1 || d == 4) << r << " copied " << d;
        ++donors[static_cast<std::size_t>(d)];
      } else {
        ASSERT_EQ(d, -1) << r;
      }
    }
  }
  EXPECT_NEAR(donors[1] / 4000.0, 0.5, 0.05);
  // Higher is better flips it; 4 members with fraction 0.25: one each side.
  const Policy q = Policy::truncation(0.25);
  auto rng = DecisionRng::derive(5, 0, 0, 4);
  EXPECT_EQ(q.chooseDonor(input(1, {0.5, 0.1, 0.9, 0.3}, true), rng), 2);
  EXPECT_EQ(q.chooseDonor(input(2, {0.5, 0.1, 0.9, 0.3}, true), rng), -1);
}

TEST(PopulationPolicy, TournamentCopiesARandomPeerOnlyWhenBetter) {
  const Policy p = Policy::tournament();
  const std::vector<double> s = {3, 1, 2, 4};  // lower is better
  std::vector<int> hits(4, 0);
  for (int i = 0; i < 3000; ++i) {
    auto a = DecisionRng::derive(9, 1, i, 4);
    EXPECT_EQ(p.chooseDonor(input(1, s), a), -1);  // the best never copies
    auto b = DecisionRng::derive(9, 3, i, 4);
    const int d = p.chooseDonor(input(3, s), b);   // the worst always does
    ASSERT_TRUE(d >= 0 && d != 3);
    ++hits[static_cast<std::size_t>(d)];
    auto c = DecisionRng::derive(9, 0, i, 4);
    const int e = p.chooseDonor(input(0, s), c);   // rank 0 copies 1 or 2, never 3
    ASSERT_TRUE(e == -1 || e == 1 || e == 2);
  }
  for (int r : {0, 1, 2}) EXPECT_NEAR(hits[r] / 3000.0, 1 / 3.0, 0.04);
}

TEST(PopulationPolicy, PerturbMultipliesEachByPointEightOrOnePointTwo) {
  int up = 0;
  for (int i = 0; i < 200; ++i) {
    auto rng = DecisionRng::derive(1, 0, i, 4);
    const Hyperparams h = gradagg::perturb({{"lr", 0.5}, {"wd", 2.0}}, rng);
    for (const auto& [name, base] : Hyperparams{{"lr", 0.5}, {"wd", 2.0}}) {
      const double v = h.at(name);
      ASSERT_TRUE(v == base * 0.8 || v == base * 1.2) << name << " " << v;
      up += v == base * 1.2;
    }
  }
  EXPECT_NEAR(up / 400.0, 0.5, 0.1);
}

}  // namespace

// ---- populations of real members ----------------------------------------------

namespace {

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
      const auto rows = torch::arange((c.step * 8 + c.rank * 3) % 56, (c.step * 8 + c.rank * 3) % 56 + 8);
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
  return Policy::custom("1<-0", [](const PolicyInput& in, DecisionRng&) { return in.rank == 1 ? 0 : -1; });
}

void expectEqual(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(torch::equal(a[k], b[k])) << what << " tensor " << k;
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
    auto& st = static_cast<torch::optim::SGDParamState&>(*opt.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
    bufs.push_back(st.momentum_buffer().clone());
  }
  return {bufs, lr.toDouble()};  // the lr saved with the state
}

class PopulationTest : public gradagg_test::GradaggTest, public ::testing::WithParamInterface<std::tuple<bool, bool>> {};

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
  for (size_t k = 0; k < momentum.size(); ++k) same = same && torch::equal(momentum[k], donor_momentum[k]);
  EXPECT_EQ(same, copy_state);
  population.shutdown();
}
INSTANTIATE_TEST_SUITE_P(Options, PopulationTest, ::testing::Combine(::testing::Bool(), ::testing::Bool()));

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
    expectEqual(sgdState(got[r].optimizer_state).first, sgdState(want[r].optimizer_state).first, who + " momentum");
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
  if (const auto e = expectThrows<gradagg::WorkerDied>([&] { population.generation(); }))
    EXPECT_EQ(e->rank(), 2);
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
  auto* killed = static_cast<std::atomic<int>*>(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE,
                                                       MAP_SHARED | MAP_ANONYMOUS, -1, 0));
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
    for (int r = 0; r < 4; ++r) EXPECT_TRUE(torch::isfinite(population.snapshot(r).parameters[0]).all().item<bool>());
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

TEST(PopulationOptionsTest, BadOptionsNameTheField) {
  gradagg::PopulationOptions o;
  o.workers = 0;
  EXPECT_THROW(o.validate(), gradagg::InvalidArgument);
  o.workers = 2;
  o.policy = Policy::random(0.1);
  o.optimizer_state_bytes = 0;
  expectThrows<gradagg::InvalidArgument>([&] { o.validate(); }, "copy_optimizer_state");
}

}  // namespace
