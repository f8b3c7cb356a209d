#include <gradagg/options.h>

#include <sched.h>

#include <algorithm>
#include <thread>

#include <fmt/format.h>

#include <gradagg/errors.h>

namespace gradagg {

int availableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

void Options::validate() const {
  if (workers < 1 || workers > kMaxWorkers)
    throw InvalidArgument(
        fmt::format("Options.workers: expected 1..{}, got {}", kMaxWorkers, workers));
  if (threads_per_worker < 0)
    throw InvalidArgument(fmt::format(
        "Options.threads_per_worker: expected >= 0 (0 = cores / workers), got {}",
        threads_per_worker));
  if (parent_threads < 0)
    throw InvalidArgument(fmt::format(
        "Options.parent_threads: expected >= 0 (0 = leave as is), got {}", parent_threads));
  if (step_timeout.count() <= 0)
    throw InvalidArgument(
        fmt::format("Options.step_timeout: expected > 0 ms, got {} ms", step_timeout.count()));
  if (max_consecutive_skips < 0)
    throw InvalidArgument(fmt::format("Options.max_consecutive_skips: expected >= 0, got {}",
                                      max_consecutive_skips));
  if (max_restarts < 0)
    throw InvalidArgument(fmt::format("Options.max_restarts: expected >= 0, got {}", max_restarts));
  if (shutdown_timeout.count() < 0)
    throw InvalidArgument(fmt::format("Options.shutdown_timeout: expected >= 0 ms, got {} ms",
                                      shutdown_timeout.count()));
}

int Options::resolvedThreadsPerWorker() const {
  if (threads_per_worker > 0) return threads_per_worker;
  return std::max(1, availableCores() / std::max(1, workers));
}

}  // namespace gradagg
