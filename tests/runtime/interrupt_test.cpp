// The interrupt request (runtime/interrupt.h): its patience is capped like
// every timeout here, so "never" (milliseconds::max()) means a long wait, not
// an overflow that ends every wait at once.
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include <gradagg/interrupt.h>

#include "runtime/interrupt.h"

namespace gradagg_test {
namespace {

using gradagg::detail::interruptDue;
using gradagg::detail::monotonicNowNs;

TEST(Interrupt, APatienceOfMillisecondsMaxLetsAWaitGoOn) {
  gradagg::interruptWaits(std::chrono::milliseconds::max());
  EXPECT_FALSE(interruptDue(monotonicNowNs())) << "a wait that began now ended at once";
  EXPECT_TRUE(interruptDue(0)) << "the rendezvous ends at once, whatever the patience";
  gradagg::detail::clearInterrupt();
  EXPECT_FALSE(interruptDue(0));
}

TEST(Interrupt, AWaitEndsOnceThePatienceHasPassed) {
  const auto began = monotonicNowNs();
  gradagg::interruptWaits(std::chrono::milliseconds(50));
  EXPECT_FALSE(interruptDue(began));
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  EXPECT_TRUE(interruptDue(began));
  gradagg::detail::clearInterrupt();
}

}  // namespace
}  // namespace gradagg_test
