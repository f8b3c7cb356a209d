// Exploit policies, explore, the decision generator and option checks (torch-free).
// Every random choice draws from a DecisionRng derived from (seed, rank, step,
// stream), with our own uniform mapping, so decisions are the same on any
// standard library and after a resume.
#include <algorithm>
#include <cmath>
#include <numeric>

#include <fmt/format.h>

#include <gradagg/population.h>

#include "runtime/mix.h"

namespace gradagg {

namespace {
using detail::kGoldenGamma;
constexpr auto mix = detail::mix64;

// Ranks sorted best first (ties: lower rank first).
std::vector<int> bestFirst(const PolicyInput& in) {
  std::vector<int> order(static_cast<std::size_t>(in.workers));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return scoreBetter(in.scores[a], in.scores[b], in.higher_is_better);
  });
  return order;
}

// A uniformly chosen rank other than `rank`.
int otherThan(int rank, int workers, DecisionRng& rng) {
  const int k = rng.below(workers - 1);
  return k >= rank ? k + 1 : k;
}
}  // namespace

DecisionRng DecisionRng::derive(std::uint64_t seed, int rank, std::int64_t step,
                                std::uint64_t stream) {
  std::uint64_t s = mix(seed + kGoldenGamma);
  s = mix(s ^ (static_cast<std::uint64_t>(rank) + 0x632be59bd9b4e019ULL));
  s = mix(s ^ (static_cast<std::uint64_t>(step) * kGoldenGamma));
  return DecisionRng(mix(s ^ (stream + 1)));
}

std::uint64_t DecisionRng::next() {
  state_ += kGoldenGamma;
  return mix(state_);
}

double DecisionRng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

int DecisionRng::below(int n) {
  const int k = static_cast<int>(uniform() * n);
  return std::min(k, n - 1);
}

Policy Policy::none() {
  return Policy("none", [](const PolicyInput&, DecisionRng&) { return -1; });
}

Policy Policy::random(double p) {
  if (!(p >= 0 && p <= 1))
    throw InvalidArgument(fmt::format("Policy::random: p = {} is not in [0, 1]", p));
  return Policy(fmt::format("random(p={})", p), [p](const PolicyInput& in, DecisionRng& rng) {
    if (in.workers < 2) return -1;
    const double u = rng.uniform();
    const int donor = otherThan(in.rank, in.workers, rng);
    return u < p ? donor : -1;
  });
}

Policy Policy::truncation(double fraction) {
  if (!(fraction > 0 && fraction <= 0.5))
    throw InvalidArgument(
        fmt::format("Policy::truncation: fraction = {} is not in (0, 0.5]", fraction));
  return Policy(
      fmt::format("truncation({})", fraction), [fraction](const PolicyInput& in, DecisionRng& rng) {
        if (in.workers < 2) return -1;
        const int count =
            std::clamp(static_cast<int>(std::lround(fraction * in.workers)), 1, in.workers / 2);
        const std::vector<int> order = bestFirst(in);
        const auto pos = std::find(order.begin(), order.end(), in.rank) - order.begin();
        if (pos < in.workers - count) return -1;
        return order[static_cast<std::size_t>(rng.below(count))];
      });
}

Policy Policy::tournament() {
  return Policy("tournament", [](const PolicyInput& in, DecisionRng& rng) {
    if (in.workers < 2) return -1;
    const int peer = otherThan(in.rank, in.workers, rng);
    return scoreBetter(in.scores[peer], in.scores[in.rank], in.higher_is_better) ? peer : -1;
  });
}

Policy Policy::custom(std::string name, Fn fn) {
  if (!fn) throw InvalidArgument("Policy::custom: empty function");
  return Policy(std::move(name), std::move(fn));
}

Hyperparams perturb(const Hyperparams& hp, DecisionRng& rng) {
  Hyperparams out = hp;
  for (auto& [name, value] : out) value *= rng.uniform() < 0.5 ? 0.8 : 1.2;
  return out;
}

void PopulationOptions::validate() const {
  const auto bad = [](const char* field, const std::string& why) {
    throw InvalidArgument(fmt::format("PopulationOptions::{}: {}", field, why));
  };
  if (workers < 1 || workers > kMaxWorkers)
    bad("workers", fmt::format("{} is not in [1, {}]", workers, kMaxWorkers));
  if (publish_interval < 1) bad("publish_interval", fmt::format("{} < 1", publish_interval));
  if (ready_interval < 0) bad("ready_interval", fmt::format("{} < 0", ready_interval));
  if (copy_optimizer_state && optimizer_state_bytes == 0 && policy.name() != "none")
    bad("copy_optimizer_state", "needs optimizer_state_bytes > 0 (room for the state)");
  if (explore == Explore::kResample && !resample)
    bad("resample", "Explore::kResample needs a resample function");
  if (threads_per_worker < 0) bad("threads_per_worker", "negative");
  if (step_timeout.count() <= 0) bad("step_timeout", "not positive");
  if (max_restarts < 0) bad("max_restarts", "negative");
  if (max_read_retries < 1) bad("max_read_retries", "< 1");
}

}  // namespace gradagg
