// The population policies' decisions (none, random, truncation, tournament), the
// perturbation of hyperparameters, and the options' validation. One process.
#include <vector>

#include <gtest/gtest.h>

#include <gradagg/gradagg.h>

#include "support/expect_throws.h"

namespace {

using gradagg::DecisionRng;
using gradagg::Hyperparams;
using gradagg::Policy;
using gradagg::PolicyInput;
using gradagg_test::expectThrows;

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
    const int d = p.chooseDonor(input(3, s), b);  // the worst always does
    ASSERT_TRUE(d >= 0 && d != 3);
    ++hits[static_cast<std::size_t>(d)];
    auto c = DecisionRng::derive(9, 0, i, 4);
    const int e = p.chooseDonor(input(0, s), c);  // rank 0 copies 1 or 2, never 3
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
