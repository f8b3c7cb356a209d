// The torch-free core: header validation (with a fuzz loop), the range split,
// the weighted sum and the finiteness check, against plain loops.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/layout.h"
#include "core/reduce.h"

namespace gradagg::detail {
namespace {

struct HeaderFixture : ::testing::Test {
  static constexpr std::size_t kPage = 4096;
  void SetUp() override {
    LayoutSizes s;
    s.workers = 3;
    s.param_count = 4;
    s.buffer_count = 2;
    s.param_bytes = 64 * 40;
    s.buffer_bytes = 64 * 3;
    layout = Layout::plan(s, kPage);
    memory.assign(layout.segment_bytes, std::byte{0});
    initHeader(memory.data(), layout, kPage);
  }
  Header& header() { return *reinterpret_cast<Header*>(memory.data()); }
  std::string validate() { return validateHeader(memory.data(), memory.size()); }
  Layout layout;
  std::vector<std::byte> memory;
};

TEST_F(HeaderFixture, AFreshHeaderIsValid) { EXPECT_EQ(validate(), ""); }

TEST_F(HeaderFixture, EachCorruptedIdentityFieldIsReported) {
  const std::vector<std::pair<std::string, std::function<void(Header&)>>> cases = {
      {"magic", [](Header& h) { h.magic ^= 1; }},
      {"version", [](Header& h) { h.layout_version += 1; }},
      {"header", [](Header& h) { h.header_bytes -= 64; }},
      {"page", [](Header& h) { h.page_bytes = 3000; }},
      {"workers", [](Header& h) { h.layout.sizes.workers = 0; }},
      {"offsets", [](Header& h) { h.layout.sizes.workers = 2; }},
      {"sizes", [](Header& h) { h.layout.sizes.param_bytes = std::uint64_t{1} << 60; }},
      {"multiples", [](Header& h) { h.layout.sizes.param_bytes += 8; }},
      {"fit", [](Header& h) { h.layout.sizes.param_count = 1000; }},
      {"offsets", [](Header& h) { h.layout.result_offset[1] += 64; }},
      {"offsets", [](Header& h) { h.layout.slot_bytes -= 64; }},
  };
  for (const auto& [name, corrupt] : cases) {
    SetUp();
    corrupt(header());
    EXPECT_NE(validate(), "") << "corrupting " << name << " went unnoticed";
  }
}

TEST_F(HeaderFixture, ASegmentLargerThanTheMappingIsReported) {
  EXPECT_NE(validateHeader(memory.data(), memory.size() - kPage), "");
  EXPECT_NE(validateHeader(memory.data(), sizeof(Header) - 1), "");
  EXPECT_NE(validateHeader(nullptr, 0), "");
}

TEST_F(HeaderFixture, RandomCorruptionNeverCrashesAndIsCaughtAgainstTheExpectedLayout) {
  std::mt19937_64 rng(42);
  const std::size_t identity = offsetof(Header, command_seq);
  int caught = 0;
  for (int i = 0; i < 20000; ++i) {
    SetUp();
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      const std::size_t at = rng() % identity;
      memory[at] ^= static_cast<std::byte>(1u << (rng() % 8));
    }
    const Header& h = header();
    // Alone, the header must at least be self-consistent and inside the mapping.
    if (validate().empty()) {
      EXPECT_TRUE(Layout::plan(h.layout.sizes, h.page_bytes) == h.layout);
      EXPECT_LE(h.layout.segment_bytes, memory.size());
    }
    // Against the layout a worker expects, only flips in padding may pass.
    const bool same = h.magic == kMagic && h.layout_version == kLayoutVersion &&
                      h.header_bytes == sizeof(Header) && h.page_bytes == kPage &&
                      h.layout == layout;
    const bool passed = validateHeader(memory.data(), memory.size(), &layout).empty();
    EXPECT_EQ(passed, same) << "iteration " << i;
    caught += passed ? 0 : 1;
  }
  EXPECT_GT(caught, 15000);
}

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

template <typename T>
void checkWeightedSum(ElementType type, int n, std::size_t count) {
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
  std::vector<T> out(count, T(-1));
  weightedSum(type, out.data(), ptrs.data(), w.data(), n, count);
  for (std::size_t k = 0; k < count; ++k) {
    double want = 0;
    for (int i = 0; i < n; ++i) want += w[i] * static_cast<double>(in[i][k]);
    ASSERT_EQ(out[k], static_cast<T>(want)) << "element " << k;  // same order, same rounding
  }
}

TEST(WeightedSum, EqualsThePlainLeftToRightSumForEveryCountAndWorkerCount) {
  for (int n : {1, 2, 3, 4, 9})
    for (std::size_t count : {0u, 1u, 7u, 511u, 512u, 513u, 5000u}) {
      checkWeightedSum<float>(ElementType::kFloat32, n, count);
      checkWeightedSum<double>(ElementType::kFloat64, n, count);
    }
}

TEST(ReduceRange, WritesOnlyFlaggedParametersInsideItsRange) {
  // Two float parameters at 0 (20 elements = 80 bytes -> 128) and 128 (10 elements).
  const std::vector<FlatTensor> params{{0, 20, ElementType::kFloat32},
                                       {128, 10, ElementType::kFloat32}};
  std::vector<float> a(64, 1.0f), b(64, 3.0f), out(64, -7.0f);
  std::uint8_t flags_a[2] = {1, 0}, flags_b[2] = {0, 0};
  const SlotView slots[2] = {{reinterpret_cast<std::byte*>(a.data()), flags_a},
                             {reinterpret_cast<std::byte*>(b.data()), flags_b}};
  const double w[2] = {0.25, 0.75};
  reduceRange(params, ByteRange{64, 192}, reinterpret_cast<std::byte*>(out.data()), slots, w, 2);
  for (int k = 0; k < 16; ++k) EXPECT_EQ(out[k], -7.0f) << k;  // before the range
  for (int k = 16; k < 20; ++k) EXPECT_EQ(out[k], 0.25f + 2.25f) << k;
  for (int k = 32; k < 42; ++k) EXPECT_EQ(out[k], -7.0f) << k;  // nobody flagged it
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

}  // namespace
}  // namespace gradagg::detail
