// The parent's waits and their shared deadline (runtime/control.h): time this
// process was stopped is not the workers' lateness, wherever in a command it
// falls — during a wait, or between two waits of the same command (a step with
// early buckets waits once per bucket, then for the reduction).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include <gradagg/errors.h>

#include "runtime/control.h"
#include "runtime/sync.h"

namespace gradagg::detail {
namespace {

using namespace std::chrono_literals;

// A channel to one "worker" that never answers by itself (it sleeps until
// killed), and two arrive lines that the test releases as a worker would.
struct Rig {
  std::atomic<std::uint32_t> command_seq{0}, phase{0}, done_seq{0}, line_a{0}, line_b{0};
  ProcessSet processes;
  ParentChannel channel;

  Rig() {
    processes.spawn([] {
      for (;;) ::pause();
      return 0;
    });
    channel = ParentChannel(command_seq, {{&phase, &done_seq}}, processes, ChannelNames{});
    channel.started();
    channel.command({{&line_a}, {&line_b}});  // both lines now wait for one arrival
  }

  // From another thread after `delay`: the worker's arrival on `line`.
  static std::thread arriveAfter(std::atomic<std::uint32_t>& line, Clock::duration delay) {
    return std::thread([&line, delay] {
      std::this_thread::sleep_for(delay);
      line.store(0, std::memory_order_release);
      futexWakeAll(line);
    });
  }
};

TEST(ParentWaits, AStopBetweenTwoWaitsOfOneCommandMovesTheDeadline) {
  Rig rig;
  const auto since = Clock::now();
  std::thread a = Rig::arriveAfter(rig.line_a, 0ms);
  rig.channel.await(rig.line_a, 1000ms, Awaited{"step", 0}, since);
  a.join();
  // Between the two waits the parent does not run for 2.5 s (to the channel
  // this is what a SIGSTOP there looks like): 1.5 s past the step's deadline.
  std::this_thread::sleep_for(2500ms);
  std::thread b = Rig::arriveAfter(rig.line_b, 300ms);
  EXPECT_NO_THROW(rig.channel.await(rig.line_b, 1000ms, Awaited{"step", 0}, since));
  b.join();
  EXPECT_TRUE(rig.channel.usable());
}

TEST(ParentWaits, AWorkerThatDoesNotArriveStillMissesTheDeadline) {
  Rig rig;
  const auto since = Clock::now();
  try {
    rig.channel.await(rig.line_a, 300ms, Awaited{"step", 0}, since);
    ADD_FAILURE() << "no StepTimeout";
  } catch (const StepTimeout& e) {
    EXPECT_EQ(e.rank(), 0);
    EXPECT_NE(std::string(e.what()).find("worker 0 did not finish step 0 within 300 ms"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(Clock::now() - since, 1500ms);
  EXPECT_FALSE(rig.channel.usable());
}

// Run in a child that the test stops: 0 when both waits of the command ended
// well, 1 on StepTimeout, 2 on anything else.
int stoppedDuringTheFirstWait() {
  try {
    Rig rig;
    const auto since = Clock::now();
    // The worker arrives on line A 2.4 s and on line B 2.6 s after the command:
    // after the 1.5 s deadline, but before it once the 2 s stop counts.
    std::thread a = Rig::arriveAfter(rig.line_a, 2400ms);
    std::thread b = Rig::arriveAfter(rig.line_b, 2600ms);
    int rc = 0;
    try {
      rig.channel.await(rig.line_a, 1500ms, Awaited{"step", 0}, since);
      rig.channel.await(rig.line_b, 1500ms, Awaited{"step", 0}, since);
    } catch (const StepTimeout&) {
      rc = 1;
    }
    a.join();
    b.join();
    return rc;
  } catch (...) {
    return 2;
  }
}

TEST(ParentWaits, AStopDuringOneWaitStillCountsInTheNextWaitOfTheCommand) {
  // A group of our own: a stopped child of an orphaned group would get SIGCONT
  // and SIGHUP from the kernel (see tests/support/support.h).
  (void)::setpgid(0, 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(stoppedDuringTheFirstWait());
  std::this_thread::sleep_for(100ms);
  ASSERT_EQ(::kill(child, SIGSTOP), 0);
  std::this_thread::sleep_for(2000ms);
  ASSERT_EQ(::kill(child, SIGCONT), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: StepTimeout in the second wait, 2: another error";
}

}  // namespace
}  // namespace gradagg::detail
