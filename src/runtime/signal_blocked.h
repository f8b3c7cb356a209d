// SignalBlocked: one signal blocked in the calling thread while the object
// lives, for a signal the kernel sends to the thread whose call caused it
// (SIGXFSZ for a write past a file-size limit, SIGPIPE for a write to a reset
// connection): the call fails with its errno (EFBIG, EPIPE) instead of the
// process dying without a word. One left pending is taken (sigtimedwait)
// before the mask is restored. Thread-local: nothing races on the process's
// dispositions (StopSignals, the application's own handlers). Threads started
// meanwhile inherit the blocked mask and keep it: that is how gloo's and
// c10d's threads, started during a NodeGroup's rendezvous, get it.
#pragma once

#include <signal.h>

#include <ctime>

namespace gradagg::detail {

class SignalBlocked {
 public:
  explicit SignalBlocked(int signo) : signo_(signo) {
    ::sigemptyset(&set_);
    ::sigaddset(&set_, signo);
    active_ = ::pthread_sigmask(SIG_BLOCK, &set_, &previous_) == 0;
  }
  ~SignalBlocked() {
    if (!active_) return;
    const struct timespec none {};
    while (::sigtimedwait(&set_, nullptr, &none) == signo_) {
    }
    ::pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }
  SignalBlocked(const SignalBlocked&) = delete;
  SignalBlocked& operator=(const SignalBlocked&) = delete;

 private:
  int signo_;
  sigset_t set_{};
  sigset_t previous_{};
  bool active_ = false;
};

}  // namespace gradagg::detail
