// What a failed step says: the errors of the parent's step, built from what
// the workers left in their control blocks, with the hints that explain the
// common mistakes (a write into a parameter in a worker, ...).
#pragma once

#include <cstdint>
#include <string>

#include <gradagg/errors.h>

#include "model/model_binding.h"
#include "step/slots.h"

namespace gradagg::detail {

class StepErrors {
 public:
  StepErrors(const SlotReader& slots, const ModelBinding& binding, int node)
      : slots_(slots), binding_(binding), node_(node) {}

  // Worker `first` failed in step `step`: its message in full (a Python
  // traceback), then every other worker that failed, by rank and phase.
  WorkerFailed workerFailed(int first, std::int64_t step) const;
  // What another node's workers did to step `step`: no node applied it.
  NodeFailed elsewhere(const char* what, std::int64_t step, const std::string& why) const;
  // `died` again, with a hint when the worker was killed by a write into the
  // snapshot (its SIGSEGV handler left the offset): the parameter it wrote.
  [[noreturn]] void rethrowWithHint(const WorkerDied& died) const;

 private:
  // The parameter or buffer at `offset` in the snapshot, as "parameter 'w'".
  std::string tensorAt(std::int64_t offset) const;

  const SlotReader& slots_;
  const ModelBinding& binding_;
  int node_;
};

}  // namespace gradagg::detail
