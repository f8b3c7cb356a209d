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

// The identity's bytes that belong to a field, from the structs' definitions
// alone (not from validateHeader's rule): the rest is padding.
std::vector<bool> identityFieldBytes() {
  std::vector<bool> used(offsetof(Header, command_seq), false);
  auto mark = [&](std::size_t at, std::size_t bytes) {
    for (std::size_t i = 0; i < bytes; ++i) used[at + i] = true;
  };
  mark(offsetof(Header, magic), sizeof(Header::magic));
  mark(offsetof(Header, layout_version), sizeof(Header::layout_version));
  mark(offsetof(Header, header_bytes), sizeof(Header::header_bytes));
  mark(offsetof(Header, page_bytes), sizeof(Header::page_bytes));
  const std::size_t sizes = offsetof(Header, layout) + offsetof(Layout, sizes);
  mark(sizes + offsetof(LayoutSizes, workers), sizeof(std::uint32_t));
  mark(sizes + offsetof(LayoutSizes, param_count), sizeof(std::uint32_t));
  mark(sizes + offsetof(LayoutSizes, buffer_count), sizeof(std::uint32_t));
  // Then five 64-bit sizes: param_bytes .. row_bytes.
  static_assert(sizeof(LayoutSizes) == offsetof(LayoutSizes, param_bytes) + 5 * 8);
  mark(sizes + offsetof(LayoutSizes, param_bytes), 5 * sizeof(std::uint64_t));
  // The offsets: every 64-bit word from control_offset to segment_bytes.
  const std::size_t offsets = offsetof(Header, layout) + offsetof(Layout, control_offset);
  const std::size_t end = offsetof(Header, layout) + offsetof(Layout, segment_bytes) + 8;
  mark(offsets, end - offsets);
  return used;
}

TEST_F(HeaderFixture, RandomCorruptionNeverCrashesAndIsCaughtAgainstTheExpectedLayout) {
  const std::vector<bool> field = identityFieldBytes();
  const std::size_t identity = field.size();
  std::mt19937_64 rng(42);
  int caught = 0, padding_only = 0;
  for (int i = 0; i < 20000; ++i) {
    SetUp();
    const std::vector<std::byte> fresh = memory;
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
    // Against the layout a worker expects, a header passes exactly when every
    // changed byte is padding (two flips of one bit change nothing).
    bool in_padding = true;
    for (std::size_t at = 0; at < identity; ++at)
      if (memory[at] != fresh[at] && field[at]) in_padding = false;
    const bool passed = validateHeader(memory.data(), memory.size(), &layout).empty();
    EXPECT_EQ(passed, in_padding) << "iteration " << i;
    caught += passed ? 0 : 1;
    padding_only += in_padding ? 1 : 0;
  }
  EXPECT_GT(caught, 15000);
  EXPECT_GT(padding_only, 0);  // the loop reached padding too
}

}  // namespace
}  // namespace gradagg::detail
