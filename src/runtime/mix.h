// splitmix64 (Steele, Lea and Flood, 2014): the seeds every process derives
// from (seed, rank, step), so a worker forked again or a resumed run draws the
// same numbers.
#pragma once

#include <cstdint>

namespace gradagg::detail {

inline constexpr std::uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ULL;

// splitmix64's finaliser: every bit of the result depends on every bit of z.
constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The seed of LibTorch's generator in worker `global_rank` at step `step`.
constexpr std::uint64_t stepSeed(std::uint64_t seed, int global_rank, std::int64_t step) {
  return mix64((seed ^ (static_cast<std::uint64_t>(global_rank) << 40) ^
                static_cast<std::uint64_t>(step)) +
               kGoldenGamma);
}

}  // namespace gradagg::detail
