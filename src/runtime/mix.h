// splitmix64 (Steele, Lea and Flood, 2014): the population's decision streams
// (the workers' seeds are gradagg::workerSeed, gradagg/shard.h).
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

}  // namespace gradagg::detail
