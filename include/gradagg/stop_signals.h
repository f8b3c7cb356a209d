// Stop signals: SIGINT, SIGTERM and SIGHUP ask the run to stop at the end of
// its current step, write its stop checkpoint and return, instead of killing it.
//
//   gradagg::StopSignals stop;                  // installs the handlers
//   for (auto position : data.steps(epoch)) {
//     if (stop.requested()) break;
//     agg.step(position);
//     opt.step();
//   }
//   if (stop.requested()) {
//     auto hold = stop.hold();                  // a second signal waits for the file
//     checkpoint.save(model, opt, state);
//     checkpoint.wait();
//     return 128 + stop.signal();
//   }
//
// The first signal sets requested() and calls interruptWaits(patience): a node
// waiting on other nodes (the rendezvous, a stopped or slow peer) ends that wait
// with gradagg::Interrupted `patience` later instead of at its timeout, while a
// step whose peers answer in time ends as usual. A second signal kills the
// process (the signal's default action), except that
//  - one within a second of the first is the same request delivered twice
//    (timeout(1) signals the program and then its process group; Ctrl-C in a
//    terminal reaches every process of the job) and is ignored;
//  - one that comes while a hold() lives (the stop checkpoint being written)
//    takes effect when it ends.
// A signal ignored at start stays ignored (SIGINT in a background job of a shell
// script, SIGHUP under nohup).
// SIGXFSZ is ignored while it lives, so a file size limit is a write error
// (a CheckpointError), not a core dump. The handlers are the process's: one
// StopSignals at a time (a second is an InvalidArgument); the previous handlers
// come back when it is destroyed. Python: gradagg.StopSignals.
#pragma once

#include <chrono>

namespace gradagg {

class StopSignals {
 public:
  explicit StopSignals(std::chrono::milliseconds patience = std::chrono::milliseconds(100));
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // Whether a stop signal came (async-signal-safe to read anywhere).
  bool requested() const noexcept;
  // The first stop signal's number (SIGINT, SIGTERM, SIGHUP), 0 before one.
  int signal() const noexcept;

  // While the returned object lives, a second stop signal waits; it takes
  // effect (kills) when the last hold ends.
  class Hold {
   public:
    Hold(Hold&& other) noexcept : active_(other.active_) { other.active_ = false; }
    Hold& operator=(Hold&&) = delete;
    ~Hold();

   private:
    friend class StopSignals;
    Hold() = default;
    bool active_ = true;
  };
  Hold hold() const;
};

}  // namespace gradagg
