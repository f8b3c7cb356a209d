// The reduction (src/step/kernels.h, flat.h, weights.h) against plain loops: the range split, the
// weighted sum, one range of flagged parameters, the finiteness check.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include "step/flat.h"
#include "step/weights.h"

namespace gradagg::detail {
namespace {

TEST(SplitRanges, CoverTheWholeGradientContiguouslyOnLineBoundaries) {
  for (std::uint64_t total : {0ull, 64ull, 640ull, 64ull * 1001, 64ull * 7}) {
    for (int parts : {1, 2, 3, 4, 7, 16}) {
      const auto ranges = splitRanges(total, parts);
      ASSERT_EQ(ranges.size(), static_cast<std::size_t>(parts));
      std::uint64_t at = 0;
      for (const auto& r : ranges) {
        EXPECT_EQ(r.begin, at);
        EXPECT_LE(r.begin, r.end);
        EXPECT_EQ(r.begin % 64, 0u);
        at = r.end;
      }
      EXPECT_EQ(at, total);
    }
  }
}

TEST(SplitRanges, OfARangeCoverItOnLineBoundaries) {
  const ByteRange tail{64 * 5, 64 * 5 + 1000};
  const auto ranges = splitRanges(tail, 3);
  ASSERT_EQ(ranges.size(), 3u);
  std::uint64_t at = tail.begin;
  for (const auto& r : ranges) {
    EXPECT_EQ(r.begin, at);
    EXPECT_LT(r.begin, r.end);
    EXPECT_EQ(r.begin % 64, 0u);
    at = r.end;
  }
  EXPECT_EQ(at, tail.end);
}

// `shift` elements into the output: a result that does not start on a line.
template <typename T>
void checkWeightedSum(ElementType type, int n, std::size_t count, std::size_t shift = 0) {
  std::mt19937 rng(n * 1000 + static_cast<int>(count));
  std::normal_distribution<double> normal;
  std::vector<std::vector<T>> in(n, std::vector<T>(count));
  std::vector<const void*> ptrs;
  std::vector<double> w(n);
  for (int i = 0; i < n; ++i) {
    for (auto& x : in[i]) x = static_cast<T>(normal(rng));
    ptrs.push_back(in[i].data());
    w[i] = (i + 1.0) / (n * (n + 1) / 2.0);
  }
  std::vector<T> buffer(count + shift + 1, T(-1));
  T* out = buffer.data() + shift;
  weightedSum(type, out, ptrs.data(), w.data(), n, count);
  for (std::size_t k = 0; k < count; ++k) {
    double want = 0;
    for (int i = 0; i < n; ++i) want += w[i] * static_cast<double>(in[i][k]);
    ASSERT_EQ(out[k], static_cast<T>(want)) << "element " << k << " of " << count << ", n = " << n;
  }
  EXPECT_EQ(out[count], T(-1)) << "past the end";
}

TEST(WeightedSum, EqualsThePlainLeftToRightSumForEveryCountAndWorkerCount) {
  // Every vectorised path this CPU has, and the portable one: the same bits.
  for (const KernelPath path : {KernelPath::kBest, KernelPath::kAvx2, KernelPath::kPortable}) {
    setKernelPathForTests(path);
    for (int n : {1, 2, 3, 4, 9})
      for (std::size_t count : {0u, 1u, 7u, 15u, 17u, 511u, 512u, 513u, 5000u}) {
        checkWeightedSum<float>(ElementType::kFloat32, n, count, count % 3);
        checkWeightedSum<double>(ElementType::kFloat64, n, count);
      }
  }
  setKernelPathForTests(KernelPath::kBest);
}

TEST(WeightedSum, Float32ResultsPastTheCachesStreamToTheSameBits) {
  // From 8 MiB of result on, float32 stores stream (non-temporal, 64-byte
  // aligned): the head before the first line, the lines and the tail.
  const std::size_t count = (std::size_t{8} << 20) / sizeof(float) + 13;
  for (const KernelPath path : {KernelPath::kBest, KernelPath::kAvx2})
    for (std::size_t shift : {0u, 1u, 5u}) {
      setKernelPathForTests(path);
      checkWeightedSum<float>(ElementType::kFloat32, 2, count, shift);
      checkWeightedSum<float>(ElementType::kFloat32, 3, count + shift, shift);
    }
  setKernelPathForTests(KernelPath::kBest);
}

template <typename T>
void checkOneSlotAtWeightOne(ElementType type) {
  // One worker's mean is its slot: signed zeros, subnormals and the extremes
  // come out as w * x computed in double would give them.
  const std::vector<T> in{T(0),
                          -T(0),
                          std::numeric_limits<T>::denorm_min(),
                          -std::numeric_limits<T>::denorm_min(),
                          std::numeric_limits<T>::max(),
                          std::numeric_limits<T>::lowest(),
                          std::numeric_limits<T>::min(),
                          T(1) / T(3)};
  const void* p = in.data();
  const double one = 1;
  std::vector<T> out(in.size(), T(7));
  weightedSum(type, out.data(), &p, &one, 1, in.size());
  for (std::size_t k = 0; k < in.size(); ++k) {
    const T want = static_cast<T>(one * static_cast<double>(in[k]));
    EXPECT_EQ(std::signbit(out[k]), std::signbit(want)) << k;
    EXPECT_EQ(out[k], want) << k;
  }
}

TEST(WeightedSum, OneSlotAtWeightOneIsThatSlotBitForBit) {
  checkOneSlotAtWeightOne<float>(ElementType::kFloat32);
  checkOneSlotAtWeightOne<double>(ElementType::kFloat64);
}

TEST(ReduceRange, WritesOnlyTrainableParametersInsideItsRange) {
  // Two float parameters at 0 (20 elements = 80 bytes -> 128) and 128 (10
  // elements, not trainable).
  const std::vector<FlatTensor> params{{0, 20, ElementType::kFloat32, true},
                                       {128, 10, ElementType::kFloat32, false}};
  std::vector<float> a(64, 1.0f), b(64, 3.0f), out(64, -7.0f);
  const std::byte* slots[2] = {reinterpret_cast<std::byte*>(a.data()),
                               reinterpret_cast<std::byte*>(b.data())};
  const double w[2] = {0.25, 0.75};
  reduceRange(params, ByteRange{64, 192}, reinterpret_cast<std::byte*>(out.data()), slots, w, 2);
  for (int k = 0; k < 16; ++k) EXPECT_EQ(out[k], -7.0f) << k;  // before the range
  for (int k = 16; k < 20; ++k) EXPECT_EQ(out[k], 0.25f + 2.25f) << k;
  for (int k = 32; k < 42; ++k) EXPECT_EQ(out[k], -7.0f) << k;  // not trainable
}

TEST(AllFinite, FindsNanAndInfinityAnywhere) {
  for (std::size_t count : {1u, 3u, 64u, 1000u}) {
    std::vector<float> f(count, 1.5f);
    std::vector<double> d(count, -2.5);
    EXPECT_TRUE(allFinite(ElementType::kFloat32, f.data(), count));
    EXPECT_TRUE(allFinite(ElementType::kFloat64, d.data(), count));
    for (std::size_t at : {std::size_t{0}, count / 2, count - 1}) {
      for (double bad : {std::nan(""), HUGE_VAL, -HUGE_VAL}) {
        auto f2 = f;
        auto d2 = d;
        f2[at] = static_cast<float>(bad);
        d2[at] = bad;
        EXPECT_FALSE(allFinite(ElementType::kFloat32, f2.data(), count)) << at;
        EXPECT_FALSE(allFinite(ElementType::kFloat64, d2.data(), count)) << at;
      }
    }
  }
  const float big = std::numeric_limits<float>::max();
  EXPECT_TRUE(allFinite(ElementType::kFloat32, &big, 1));
}

// bf16 and fp16: widened exactly, summed in float left to right, rounded once,
// with LibTorch's own conversions (c10::BFloat16, c10::Half) as the reference.
template <typename H>
void checkHalfWeightedSum(ElementType type, int n, std::size_t count) {
  std::mt19937 rng(n * 7 + static_cast<int>(count));
  std::normal_distribution<float> normal;
  std::vector<std::vector<std::uint16_t>> in(n, std::vector<std::uint16_t>(count));
  std::vector<const void*> ptrs;
  std::vector<double> w(n);
  for (int i = 0; i < n; ++i) {
    for (auto& v : in[i]) v = H(normal(rng) * 3.0f).x;
    ptrs.push_back(in[i].data());
    w[i] = 1.0 / (i + 1.5);
  }
  std::vector<std::uint16_t> out(count);
  weightedSum(type, out.data(), ptrs.data(), w.data(), n, count);
  for (std::size_t k = 0; k < count; ++k) {
    float acc =
        static_cast<float>(w[0]) * static_cast<float>(H(in[0][k], typename H::from_bits_t{}));
    for (int i = 1; i < n; ++i)
      acc += static_cast<float>(w[i]) * static_cast<float>(H(in[i][k], typename H::from_bits_t{}));
    ASSERT_EQ(out[k], H(acc).x) << "element " << k << " of " << count << ", n = " << n;
  }
}

TEST(WeightedSum, BFloat16AndFloat16SumInFloatAndRoundOnceAsLibTorchRounds) {
  // Every vectorised path this CPU has, and the portable one: the same bits.
  for (const KernelPath path : {KernelPath::kBest, KernelPath::kAvx2, KernelPath::kPortable}) {
    setKernelPathForTests(path);
    for (int n : {1, 2, 3, 5}) {
      for (std::size_t count : {1u, 7u, 15u, 16u, 17u, 512u, 513u, 2000u}) {
        checkHalfWeightedSum<c10::BFloat16>(ElementType::kBFloat16, n, count);
        checkHalfWeightedSum<c10::Half>(ElementType::kFloat16, n, count);
      }
    }
  }
  setKernelPathForTests(KernelPath::kBest);
  // NaN stays NaN through the rounding.
  const std::uint16_t nan = c10::BFloat16(std::numeric_limits<float>::quiet_NaN()).x;
  const void* p = &nan;
  const double one = 1;
  std::uint16_t out = 0;
  weightedSum(ElementType::kBFloat16, &out, &p, &one, 1, 1);
  EXPECT_TRUE(std::isnan(static_cast<float>(c10::BFloat16(out, c10::BFloat16::from_bits()))));
}

TEST(AllFinite, FindsNanAndInfinityInHalfTypes) {
  for (const auto type : {ElementType::kBFloat16, ElementType::kFloat16}) {
    const auto bits = [&](float v) {
      return type == ElementType::kBFloat16 ? c10::BFloat16(v).x : c10::Half(v).x;
    };
    std::vector<std::uint16_t> v(100, bits(1.5f));
    EXPECT_TRUE(allFinite(type, v.data(), v.size()));
    v[37] = bits(std::numeric_limits<float>::infinity());
    EXPECT_FALSE(allFinite(type, v.data(), v.size()));
    v[37] = bits(-std::numeric_limits<float>::quiet_NaN());
    EXPECT_FALSE(allFinite(type, v.data(), v.size()));
    v[37] = bits(65504.0f);  // the largest finite fp16
    EXPECT_TRUE(allFinite(type, v.data(), v.size()));
  }
}

}  // namespace
}  // namespace gradagg::detail

namespace gradagg::detail {
namespace {

TEST(WeightRule, GivesEachSlotItsShareOfTheSamplesAndTheFactorItsSlotNeeds) {
  const SlotCounts counts[] = {{3, 1}, {1, 1}, {4, 1}};
  SlotWeight w[3];
  WeightRule by_samples;
  EXPECT_EQ(by_samples.apply(counts, 3, w), 8.0);
  EXPECT_EQ(w[0].weight, 3.0 / 8);
  EXPECT_EQ(w[2].factor, 4.0 / 8);
  WeightRule equal{true, 1, false};
  EXPECT_EQ(equal.apply(counts, 3, w), 3.0);
  EXPECT_EQ(w[1].weight, 1.0 / 3);
  // Accumulating 2 micro-batches: a slot holds sum_j n_j g_j, or sum_j g_j.
  const SlotCounts two[] = {{3, 2}, {1, 2}, {4, 2}};
  WeightRule accumulated{false, 2, false};
  accumulated.apply(two, 3, w);
  EXPECT_EQ(w[0].factor, (3.0 / 8) / 3);
  WeightRule equal_accumulated{true, 2, false};
  equal_accumulated.apply(two, 3, w);
  EXPECT_EQ(w[0].factor, (1.0 / 3) / 2);
  // Divided later (a stage combines groups): unnormalised, D still reported.
  WeightRule later{false, 1, true};
  EXPECT_EQ(later.apply(counts, 3, w), 8.0);
  EXPECT_EQ(w[2].weight, 4.0);
}

TEST(WeightRule, LeavesOutWorkersWithNoSamples) {
  const SlotCounts counts[] = {{3, 1}, {0, 0}, {5, 1}};
  SlotWeight w[3];
  EXPECT_EQ(WeightRule{}.apply(counts, 3, w), 8.0);
  EXPECT_EQ(w[1].weight, 0.0);
  EXPECT_EQ(w[1].factor, 0.0);
  EXPECT_EQ(w[2].weight, 5.0 / 8);
  // Equal weighting counts contributors, not workers.
  WeightRule equal{true, 1, false};
  EXPECT_EQ(equal.apply(counts, 3, w), 2.0);
  EXPECT_EQ(w[0].weight, 0.5);
  // Accumulating, the equal factor divides by the micro-batches that had samples.
  const SlotCounts partial[] = {{6, 2}, {1, 1}};
  WeightRule equal_accumulated{true, 3, false};
  equal_accumulated.apply(partial, 2, w);
  EXPECT_EQ(w[0].factor, 0.5 / 2);
  EXPECT_EQ(w[1].factor, 0.5 / 1);
  // Nobody had a sample: D = 0 and every weight 0.
  const SlotCounts none[] = {{0, 0}, {0, 0}};
  EXPECT_EQ(WeightRule{}.apply(none, 2, w), 0.0);
  EXPECT_EQ(w[0].weight, 0.0);
}

}  // namespace
}  // namespace gradagg::detail
