// StopSignals (include/gradagg/stop_signals.h): the handler's state is a few
// lock-free atomics, written by the handler and read by the program, so both
// sides are async-signal-safe. One instance at a time owns the handlers.
#include <gradagg/stop_signals.h>

#include <signal.h>

#include <atomic>

#include <gradagg/errors.h>
#include <gradagg/interrupt.h>

#include "runtime/interrupt.h"
#include "runtime/stop_signals.h"

namespace gradagg {

namespace {

constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};
constexpr std::int64_t kSameRequestNs = 1000000000;  // a second within a second: the same

std::atomic<bool> g_installed{false};
std::atomic<int> g_signal{0};             // the first stop signal, 0 before one
std::atomic<std::int64_t> g_first_ns{0};  // when it came
std::atomic<int> g_holds{0};              // Hold objects alive
std::atomic<int> g_held{0};               // a second signal that came during a hold
std::atomic<std::int64_t> g_patience_ms{100};
struct sigaction g_previous[3];
struct sigaction g_previous_xfsz;
bool g_installed_on[3] = {false, false, false};

void killWith(int signal) {
  ::signal(signal, SIG_DFL);
  ::raise(signal);  // delivered when the handler returns: the default action, now
}

void onStopSignal(int signal) {
  int none = 0;
  if (g_signal.compare_exchange_strong(none, signal)) {
    g_first_ns.store(detail::monotonicNowNs());
    interruptWaits(std::chrono::milliseconds(g_patience_ms.load()));
    return;
  }
  // 0: the first one is being handled right now on another thread: the same request.
  const std::int64_t first = g_first_ns.load();
  if (first == 0 || detail::monotonicNowNs() - first < kSameRequestNs) return;
  if (g_holds.load() > 0) {
    g_held.store(signal);
    return;
  }
  killWith(signal);
}

}  // namespace

bool detail::stopSignalsOwnSigint() noexcept { return g_installed.load() && g_installed_on[0]; }

StopSignals::StopSignals(std::chrono::milliseconds patience) {
  if (g_installed.exchange(true))
    throw InvalidArgument(
        "gradagg::StopSignals: another StopSignals owns the stop signals' handlers; make one "
        "for the program");
  g_signal = 0;
  g_held = 0;
  g_first_ns = 0;
  g_patience_ms = patience.count();
  struct sigaction action {};
  action.sa_handler = onStopSignal;
  action.sa_flags = SA_RESTART;  // a write or fsync in progress goes on, no EINTR
  sigemptyset(&action.sa_mask);
  for (int s : kSignals) sigaddset(&action.sa_mask, s);
  for (int i = 0; i < 3; ++i) {
    g_installed_on[i] = false;
    if (::sigaction(kSignals[i], nullptr, &g_previous[i]) != 0) continue;
    // A signal ignored at start stays ignored: SIGINT in a background job of
    // a script, SIGHUP under nohup.
    if (g_previous[i].sa_handler == SIG_IGN && !(g_previous[i].sa_flags & SA_SIGINFO)) continue;
    g_installed_on[i] = ::sigaction(kSignals[i], &action, nullptr) == 0;
  }
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ::sigaction(SIGXFSZ, &ignore, &g_previous_xfsz);
}

StopSignals::~StopSignals() {
  for (int i = 0; i < 3; ++i)
    if (g_installed_on[i]) ::sigaction(kSignals[i], &g_previous[i], nullptr);
  ::sigaction(SIGXFSZ, &g_previous_xfsz, nullptr);
  g_installed = false;
}

bool StopSignals::requested() const noexcept { return g_signal.load() != 0; }
int StopSignals::signal() const noexcept { return g_signal.load(); }

StopSignals::Hold StopSignals::hold() const {
  g_holds.fetch_add(1);
  return Hold();
}

StopSignals::Hold::~Hold() {
  if (!active_) return;
  if (g_holds.fetch_sub(1) == 1)
    if (const int held = g_held.exchange(0)) killWith(held);
}

}  // namespace gradagg
