#include "aggregator/step_errors.h"

#include <signal.h>

#include <fmt/format.h>

namespace gradagg::detail {

WorkerFailed StepErrors::workerFailed(int first, std::int64_t step) const {
  const Phase phase = slots_.failedPhase(first);
  const std::string message = slots_.message(first);
  std::string others;
  for (int r = 0; r < slots_.workers(); ++r) {
    if (r == first || slots_.ok(r)) continue;
    std::string line = slots_.message(r);
    if (const auto nl = line.find('\n'); nl != std::string::npos) line.resize(nl);
    others += fmt::format("\n  worker {} failed too, in phase '{}': {}", r,
                          phaseName(slots_.failedPhase(r)), line);
  }
  return WorkerFailed(fmt::format("gradagg: worker {} failed in phase '{}' of step {}: {}{}", first,
                                  phaseName(phase), step, message, others),
                      first, phase, message);
}

NodeFailed StepErrors::elsewhere(const char* what, std::int64_t step,
                                 const std::string& why) const {
  return NodeFailed(fmt::format("gradagg: {} in step {}{}; no node applied the step (this is "
                                "node {})",
                                what, step, why, node_),
                    node_);
}

std::string StepErrors::tensorAt(std::int64_t offset) const {
  const auto at = static_cast<std::uint64_t>(offset);
  for (const TensorEntry& p : binding_.params())
    if (at >= p.offset && at < p.offset + p.bytes) return fmt::format("parameter '{}'", p.name);
  const std::uint64_t buffers = binding_.bufferRegion() - binding_.paramRegion();
  for (const TensorEntry& b : binding_.buffers())
    if (at >= buffers + b.offset && at < buffers + b.offset + b.bytes)
      return fmt::format("buffer '{}'", b.name);
  return "the parameters";
}

void StepErrors::rethrowWithHint(const WorkerDied& died) const {
  const std::int64_t offset = slots_.faultOffset(died.rank());
  if (died.signal() != SIGSEGV || offset < 0) throw died;
  throw WorkerDied(
      fmt::format("{}: it wrote into {}, which is read-only in workers (the parent's master "
                  "values; change parameters in the parent, after step(), e.g. with the "
                  "optimizer, and never in the shard function)",
                  died.what(), tensorAt(offset)),
      died.rank(), died.phase(), died.exitStatus(), died.signal());
}

}  // namespace gradagg::detail
