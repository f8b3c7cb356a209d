// gradagg::StopSignals (gradagg/stop_signals.h): a stop signal is a request the
// loop reads, not a death; the same request twice is one; a later one kills,
// but waits for a hold (the stop checkpoint); the handlers are given back.
// Each signal is raised in a forked child: the request ends the waits of the
// whole process (interruptWaits), which the next test must not inherit.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include <gradagg/errors.h>
#include <gradagg/stop_signals.h>

#include "runtime/interrupt.h"

namespace gradagg_test {
namespace {

using gradagg::StopSignals;
using namespace std::chrono_literals;

struct ChildEnd {
  std::string said;  // what the child wrote on its pipe
  int status = 0;    // waitpid's
};

// Runs `body` in a forked child that writes what it has to say on `out`.
ChildEnd inChild(const std::function<void(int out)>& body) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    body(fds[1]);
    ::_exit(0);
  }
  ::close(fds[1]);
  ChildEnd end;
  char buf[256];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) end.said.append(buf, n);
  ::close(fds[0]);
  ::waitpid(pid, &end.status, 0);
  return end;
}

void say(int out, const std::string& what) { (void)!::write(out, what.data(), what.size()); }

TEST(StopSignals, AStopSignalIsARequestAndTheSameRequestTwiceIsOne) {
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    const ChildEnd end = inChild([sig](int out) {
      StopSignals stop;
      say(out, stop.requested() ? "early " : "");
      ::raise(sig);
      say(out, stop.requested() && stop.signal() == sig ? "requested " : "not requested ");
      say(out, gradagg::detail::interruptDue(0) ? "waits end " : "waits go on ");
      ::raise(sig);  // within a second: the same request (timeout(1), Ctrl-C to the group)
      say(out, "alive");
    });
    EXPECT_EQ(end.said, "requested waits end alive") << "signal " << sig;
    EXPECT_TRUE(WIFEXITED(end.status) && WEXITSTATUS(end.status) == 0) << "signal " << sig;
  }
}

TEST(StopSignals, ALaterSecondSignalKillsButWaitsForAHold) {
  const ChildEnd end = inChild([](int out) {
    StopSignals stop;
    ::raise(SIGTERM);
    std::this_thread::sleep_for(1100ms);
    {
      auto hold = stop.hold();
      ::raise(SIGTERM);  // held: the checkpoint is being written
      say(out, "held ");
    }
    say(out, "survived the hold");
  });
  EXPECT_EQ(end.said, "held ");
  EXPECT_TRUE(WIFSIGNALED(end.status) && WTERMSIG(end.status) == SIGTERM) << end.status;
}

TEST(StopSignals, OneAtATimeAndTheHandlersAreGivenBack) {
  const ChildEnd end = inChild([](int out) {
    struct sigaction before {};
    ::sigaction(SIGTERM, nullptr, &before);
    {
      StopSignals stop;
      try {
        StopSignals second;
        say(out, "a second was made; ");
      } catch (const gradagg::InvalidArgument& e) {
        say(out, std::string(e.what()).find("another StopSignals") != std::string::npos
                     ? "refused; "
                     : "refused without the reason; ");
      }
    }
    struct sigaction after {};
    ::sigaction(SIGTERM, nullptr, &after);
    say(out, after.sa_handler == before.sa_handler ? "given back; " : "not given back; ");
    { StopSignals again; }  // the first one is gone: a new one may be made
    say(out, "again");
  });
  EXPECT_EQ(end.said, "refused; given back; again");
}

TEST(StopSignals, AnIgnoredSigintStaysIgnored) {
  const ChildEnd end = inChild([](int out) {
    ::signal(SIGINT, SIG_IGN);  // a background job of a shell script
    StopSignals stop;
    ::raise(SIGINT);
    say(out, stop.requested() ? "requested" : "ignored");
  });
  EXPECT_EQ(end.said, "ignored");
}

}  // namespace
}  // namespace gradagg_test
