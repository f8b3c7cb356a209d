// settleOtherThreads (src/runtime/quiet_fork.h): what forkChild() waits for
// before fork(), so that no other thread is inside a runtime's lock.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "runtime/quiet_fork.h"

namespace gradagg::detail {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A thread that spins until told to stop spinning, then sleeps on a condition
// variable until told to end.
class Spinner {
 public:
  Spinner()
      : thread_([this] {
          started_ = true;
          while (spin_.load()) {
          }
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, [this] { return end_; });
        }) {
    while (!started_.load()) std::this_thread::yield();
  }
  ~Spinner() {
    stopSpinning();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      end_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void stopSpinning() { spin_ = false; }

 private:
  std::atomic<bool> spin_{true}, started_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool end_ = false;
  std::thread thread_;
};

TEST(QuietFork, AThreadThatSpinsIsCountedAndWaitedForUntilTheBound) {
  Spinner spinner;
  EXPECT_GE(runnableOtherThreads(), 1);
  const auto t0 = Clock::now();
  EXPECT_FALSE(settleOtherThreads(20ms));
  EXPECT_GE(Clock::now() - t0, 20ms);
}

TEST(QuietFork, ThreadsAsleepOnAConditionVariableAreAtRest) {
  Spinner spinner;
  std::thread stopper([&] {
    std::this_thread::sleep_for(30ms);
    spinner.stopSpinning();
  });
  const auto t0 = Clock::now();
  EXPECT_TRUE(settleOtherThreads(10s));  // the spinner and the stopper both asleep
  EXPECT_GE(Clock::now() - t0, 25ms);    // not before the spinner stopped
  stopper.join();
  EXPECT_TRUE(settleOtherThreads(10s));
  EXPECT_EQ(runnableOtherThreads(), 0);
}

}  // namespace
}  // namespace gradagg::detail
