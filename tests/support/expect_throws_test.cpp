// expectThrows, which every error test relies on: it fails, naming the expected
// type, in each way an expected exception can go wrong, and hands back the one thrown.
#include <optional>
#include <stdexcept>
#include <system_error>

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include "support/expect_throws.h"

namespace gradagg_test {
namespace {

TEST(ExpectThrows, ReturnsTheThrownExceptionForFurtherChecks) {
  const auto e = expectThrows<std::system_error>(
      [] { throw std::system_error(ENOENT, std::generic_category(), "open /x"); }, "open /x");
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code().value(), ENOENT);
  // A derived type is caught as its base, as a catch clause would.
  EXPECT_TRUE(expectThrows<std::logic_error>([] { throw std::out_of_range("at 3"); }, "at 3"));
}

TEST(ExpectThrows, NothingThrownIsAFailureNamingTheExpectedType) {
  static std::optional<std::out_of_range> got;
  EXPECT_NONFATAL_FAILURE(got = expectThrows<std::out_of_range>([] {}, "index"),
                          "expected std::out_of_range containing \"index\"; nothing was thrown");
  EXPECT_FALSE(got.has_value());
}

TEST(ExpectThrows, AnotherTypeIsAFailureNamingBothTypesAndTheMessage) {
  static std::optional<std::out_of_range> got;
  EXPECT_NONFATAL_FAILURE(
      got = expectThrows<std::out_of_range>([] { throw std::invalid_argument("bad workers"); }),
      "expected std::out_of_range; got std::invalid_argument: bad workers");
  EXPECT_FALSE(got.has_value());
  EXPECT_NONFATAL_FAILURE(expectThrows<std::out_of_range>([] { throw 42; }),
                          "not a std::exception");
}

TEST(ExpectThrows, AMessageWithoutTheSubstringIsAFailureAndTheExceptionIsStillReturned) {
  static std::optional<std::runtime_error> got;
  EXPECT_NONFATAL_FAILURE(got = expectThrows<std::runtime_error>(
                              [] { throw std::runtime_error("worker 2 died"); }, "worker 1"),
                          "its message is: worker 2 died");
  ASSERT_TRUE(got.has_value());
  EXPECT_STREQ(got->what(), "worker 2 died");
}

TEST(ExpectThrows, TheFailureIsReportedAtTheCallersLine) {
  ::testing::TestPartResultArray results;
  int line = 0;
  {
    ::testing::ScopedFakeTestPartResultReporter intercept(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    line = __LINE__ + 1;
    expectThrows<std::out_of_range>([] {});
  }
  ASSERT_EQ(results.size(), 1);
  EXPECT_EQ(results.GetTestPartResult(0).line_number(), line);
  EXPECT_STREQ(results.GetTestPartResult(0).file_name(), __FILE__);
}

}  // namespace
}  // namespace gradagg_test
