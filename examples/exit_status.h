// How the examples end. No error escapes main: each prints one line on stderr
// naming what failed and exits with a code a script can act on (docs/errors.md):
//
//   0    done
//   1    the parity demo's two trainings differ
//   2    bad input: a flag, an environment variable, the data files, a
//        checkpoint that does not fit this run, nodes that disagree
//   3    the training failed: a worker failed, died or timed out, a node
//        failed, a non-finite gradient, a process could not be started
//   4    a file could not be written or read: checkpoint, metrics, lineage
//   70   an internal error (a bug: please report it)
//   128 + signal   stopped by SIGINT (130), SIGHUP (129) or SIGTERM (143),
//        after finishing the step and writing the checkpoint
#pragma once

#include <signal.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstdint>
#include <ctime>
#include <cstdio>
#include <exception>
#include <optional>
#include <system_error>

#include <CLI/CLI.hpp>

#include <gradagg/errors.h>
#include <gradagg/interrupt.h>

namespace example {

enum ExitCode : int {
  kDone = 0,
  kResultsDiffer = 1,
  kBadInput = 2,
  kTrainingFailed = 3,
  kFileFailed = 4,
  kInternalError = 70,
};

inline volatile std::sig_atomic_t g_stop_signal = 0;

inline int exitCodeFor(const std::exception& e) {
  // A stop signal ended a wait on the other nodes: the stop's exit code.
  if (dynamic_cast<const gradagg::Interrupted*>(&e) != nullptr && g_stop_signal != 0)
    return 128 + g_stop_signal;
  if (dynamic_cast<const gradagg::FileError*>(&e) != nullptr) return kFileFailed;
  if (dynamic_cast<const gradagg::InvalidArgument*>(&e) != nullptr) return kBadInput;
  if (dynamic_cast<const std::invalid_argument*>(&e) != nullptr) return kBadInput;
  if (dynamic_cast<const gradagg::InternalError*>(&e) != nullptr) return kInternalError;
  if (dynamic_cast<const gradagg::Error*>(&e) != nullptr) return kTrainingFailed;
  if (dynamic_cast<const std::system_error*>(&e) != nullptr) return kTrainingFailed;
  return kInternalError;
}

// Prints "<program>: <what>" and returns the exit code for `e`.
inline int fail(const char* program, const std::exception& e) {
  std::fprintf(stderr, "%s: %s\n", program, e.what());
  return exitCodeFor(e);
}

// Ends the process with `code` once stdout and stderr are flushed, without
// the static destructors: libtorch's deregister every operator kernel, which
// takes 60-170 ms here after a run that forked workers (its pages are
// copy-on-write then), time a Ctrl-C would wait for. All of ours is written
// by then: checkpoints are synced and renamed, --metrics flushed per line.
// Under ASan the usual exit stays, so that the leak check runs.
[[noreturn]] inline void exitNow(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
#if defined(__SANITIZE_ADDRESS__)
  std::exit(code);
#else
  std::_Exit(code);
#endif
}

// main() of an example: run(argc, argv), or the code and one line for an
// error; then exitNow().
template <typename Run>
[[noreturn]] void runMain(const char* program, Run&& run, int argc, char** argv) {
  int code = kInternalError;
  try {
    code = run(argc, argv);
  } catch (const std::exception& e) {
    code = fail(program, e);
  }
  exitNow(code);
}

// Parses the command line. A bad flag prints CLI11's message and gives
// kBadInput; --help prints the help and gives kDone. nullopt: go on.
inline std::optional<int> parseCommandLine(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kDone : kBadInput;
  }
}

// SIGINT, SIGTERM and SIGHUP ask the run to stop after its current step. A
// second one kills, except that
//  - one within a second of the first is the same request delivered twice
//    (timeout(1) signals the program and then its process group; Ctrl-C in a
//    terminal reaches every process of the job) and is ignored;
//  - one that comes while a checkpoint is being written (HoldStopSignals)
//    takes effect once the file is in place.
// A SIGINT ignored at start (a background job of a script) stays ignored.
// SIGXFSZ is ignored, so a file size limit is a write error the program
// reports, not a core dump.
inline volatile std::sig_atomic_t g_holding = 0;      // a checkpoint is being written
inline volatile std::sig_atomic_t g_held_signal = 0;  // a second request meanwhile
inline std::int64_t g_first_stop_ns = 0;              // written by the handler only

inline std::int64_t monotonicNs() {
  struct timespec t {};
  ::clock_gettime(CLOCK_MONOTONIC, &t);  // async-signal-safe
  return std::int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

inline void onStopSignal(int signal) {
  if (g_stop_signal == 0) {
    g_first_stop_ns = monotonicNs();
    g_stop_signal = signal;
    // A node waiting on the other nodes (at the rendezvous, for a slow or
    // stopped peer) ends that wait 100 ms on (gradagg::Interrupted) instead
    // of at its timeout; a step whose peers answer within 100 ms of each
    // wait ends as usual and the run stops at its boundary.
    gradagg::interruptWaits(std::chrono::milliseconds(100));
    return;
  }
  if (monotonicNs() - g_first_stop_ns < 1000000000) return;  // the same request, again
  if (g_holding) {
    g_held_signal = signal;
    return;
  }
  ::signal(signal, SIG_DFL);
  ::raise(signal);  // delivered when the handler returns: the default action, now
}

inline void installStopSignals() {
  struct sigaction action {};
  action.sa_handler = onStopSignal;
  sigemptyset(&action.sa_mask);
  sigaddset(&action.sa_mask, SIGINT);
  sigaddset(&action.sa_mask, SIGTERM);
  sigaddset(&action.sa_mask, SIGHUP);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGHUP, &action, nullptr);
  struct sigaction previous {};
  if (::sigaction(SIGINT, nullptr, &previous) == 0 && previous.sa_handler != SIG_IGN)
    ::sigaction(SIGINT, &action, nullptr);
  std::signal(SIGXFSZ, SIG_IGN);
}

// While one lives (around a checkpoint's save), a second stop request waits:
// it takes effect when the save is done and the file in place.
class HoldStopSignals {
 public:
  HoldStopSignals() { g_holding = 1; }
  ~HoldStopSignals() {
    g_holding = 0;
    if (const int held = g_held_signal) {
      ::signal(held, SIG_DFL);
      ::raise(held);
    }
  }
  HoldStopSignals(const HoldStopSignals&) = delete;
  HoldStopSignals& operator=(const HoldStopSignals&) = delete;
};

inline int stopSignal() { return g_stop_signal; }

}  // namespace example
