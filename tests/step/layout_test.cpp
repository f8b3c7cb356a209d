// The segment's header (src/step/layout.h): a fresh one is valid, every corrupted
// identity field is reported, and a fuzz loop of bit flips never crashes and is
// caught against the layout a worker expects.
#include <cstddef>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "step/layout.h"

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

}  // namespace
}  // namespace gradagg::detail
