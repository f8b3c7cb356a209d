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
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <optional>
#include <system_error>

#include <CLI/CLI.hpp>

#include <gradagg/errors.h>
#include <gradagg/interrupt.h>
#include <gradagg/stop_signals.h>

namespace example {

enum ExitCode : int {
  kDone = 0,
  kResultsDiffer = 1,
  kBadInput = 2,
  kTrainingFailed = 3,
  kFileFailed = 4,
  kInternalError = 70,
};

// SIGINT, SIGTERM and SIGHUP ask the run to stop after its current step:
// gradagg::StopSignals (gradagg/stop_signals.h), one for the program, made by
// the first call (main's first lines). A second signal kills, except one
// within a second of the first (the same request twice) or one while a
// checkpoint is being written (stopSignals().hold()), which waits for the file.
inline gradagg::StopSignals& stopSignals() {
  static gradagg::StopSignals stop(std::chrono::milliseconds(100));
  return stop;
}

inline int stopSignal() { return stopSignals().signal(); }

inline int exitCodeFor(const std::exception& e) {
  // A stop signal ended a wait on the other nodes: the stop's exit code.
  if (dynamic_cast<const gradagg::Interrupted*>(&e) != nullptr && stopSignal() != 0)
    return 128 + stopSignal();
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

}  // namespace example
