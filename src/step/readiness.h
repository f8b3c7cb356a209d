// Gradient readiness, worker side: with early buckets (step/buckets.h), take
// bucket b's line as soon as every gradient of bucket b, and of the buckets
// before it, is in this worker's slot, so that the parent can sum it while
// backward goes on for the earlier layers (as c10d's Reducer marks a bucket
// ready from autograd hooks).
//
// A post hook on each hooked parameter's gradient accumulator counts it off
// during the last backward of a step (between arm() and disarm()), once: a
// second accumulation in the same backward (a reentrant backward) after its
// bucket has gone fails the step (accumulated()). A shard
// function that moves .grad elsewhere disarms it for the step: its gradient is
// not in the slot until SlotWriter::write copies it, and the lines are taken
// at the end instead.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "model/model_binding.h"
#include "runtime/control.h"
#include "step/buckets.h"
#include "step/slots.h"

namespace gradagg::detail {

class BucketReadiness {
 public:
  // `lines`: the header's bucket lines, one per early bucket of `plan`.
  BucketReadiness(ModelBinding& binding, const SlotWriter& slot, const BucketPlan& plan,
                  std::atomic<std::uint32_t>* lines, WorkerChannel& channel);
  BucketReadiness(const BucketReadiness&) = delete;
  BucketReadiness& operator=(const BucketReadiness&) = delete;

  int early() const { return early_; }
  // A step begins: no line taken yet.
  void beginStep() { next_ = 0; }
  // Around the step's last backward: the hooks count while armed.
  void arm();
  void disarm() { armed_ = false; }
  // Before arriving on `computed`, whatever happened: the lines not taken yet.
  void takeRemaining();

 private:
  void accumulated(std::size_t k, int bucket);

  ModelBinding& binding_;
  const SlotWriter& slot_;
  std::atomic<std::uint32_t>* lines_;
  WorkerChannel& channel_;
  int early_ = 0;
  std::vector<int> pending_of_;        // each early bucket's hooked parameters
  std::vector<int> pending_;           // of them, those still without this step's gradient
  std::vector<std::uint8_t> counted_;  // per parameter: accumulated in this backward already
  int next_ = 0;                       // the next line to take
  bool armed_ = false;
  std::vector<std::shared_ptr<void>> accumulators_;  // the variables hold them weakly
};

}  // namespace gradagg::detail
