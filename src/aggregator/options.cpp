#include <gradagg/options.h>

#include <sched.h>

#include <algorithm>
#include <thread>

#include <fmt/format.h>

#include <gradagg/errors.h>

#include "runtime/cores.h"

namespace gradagg {

int availableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cores = sched_getaffinity(0, sizeof(set), &set) == 0
                  ? CPU_COUNT(&set)
                  : static_cast<int>(std::thread::hardware_concurrency());
  // A container's CPU quota: its threads beyond it only take turns.
  if (const int quota = detail::cgroupCpuQuota(); quota > 0) cores = std::min(cores, quota);
  return std::max(1, cores);
}

namespace {
// Longer than detail::kLongestTimeout is taken as that (runtime/timeouts.h).
void requireTimeout(const char* field, std::chrono::milliseconds t, bool zero_allowed) {
  if (t.count() < 0 || (t.count() == 0 && !zero_allowed))
    throw InvalidArgument(fmt::format("Options.{}: expected {} ms, got {} ms", field,
                                      zero_allowed ? ">= 0" : ">= 1", t.count()));
}
}  // namespace

void Options::validate() const {
  if (workers < 1 || workers > kMaxWorkers)
    throw InvalidArgument(
        fmt::format("Options.workers: expected 1..{}, got {}", kMaxWorkers, workers));
  if (threads_per_worker < 0)
    throw InvalidArgument(
        fmt::format("Options.threads_per_worker: expected >= 0 (0 = cores / workers), got {}",
                    threads_per_worker));
  if (parent_threads < kEveryCore)
    throw InvalidArgument(fmt::format(
        "Options.parent_threads: expected >= -1 (-1 = every core, 0 = leave as is), got {}",
        parent_threads));
  requireTimeout("step_timeout", step_timeout, false);
  if (max_consecutive_skips < 0)
    throw InvalidArgument(
        fmt::format("Options.max_consecutive_skips: expected >= 0, got {}", max_consecutive_skips));
  if (accumulation_steps < 1 || accumulation_steps > (1 << 20))
    throw InvalidArgument(fmt::format("Options.accumulation_steps: expected 1..{}, got {}", 1 << 20,
                                      accumulation_steps));
  if (max_restarts < 0)
    throw InvalidArgument(fmt::format("Options.max_restarts: expected >= 0, got {}", max_restarts));
  if (nodes.nodes < 1)
    throw InvalidArgument(fmt::format("Options.nodes.nodes: expected >= 1, got {}", nodes.nodes));
  if (nodes.node_rank < 0 || nodes.node_rank >= nodes.nodes)
    throw InvalidArgument(fmt::format("Options.nodes.node_rank: expected 0..{}, got {}",
                                      nodes.nodes - 1, nodes.node_rank));
  if (nodes.nodes > 1 && nodes.store_path.empty() &&
      (nodes.master_port < 1 || nodes.master_port > 65535))
    throw InvalidArgument(
        fmt::format("Options.nodes.master_port: expected 1..65535, got {}", nodes.master_port));
  requireTimeout("nodes.timeout", nodes.timeout, false);
  if (nodes.bucket_bytes == 0)
    throw InvalidArgument("Options.nodes.bucket_bytes: expected > 0, got 0");
  if (nodes.first_bucket_bytes == 0)
    throw InvalidArgument("Options.nodes.first_bucket_bytes: expected > 0, got 0");
  if (nodes.checksum_interval < 0)
    throw InvalidArgument(fmt::format("Options.nodes.checksum_interval: expected >= 0, got {}",
                                      nodes.checksum_interval));
  if (nodes.nodes > 1 && buffers == BufferSync::kMean)
    throw InvalidArgument(
        "Options.buffers: BufferSync::kMean is not supported across nodes yet; use kFromRank0 "
        "(node 0's worker 0 wins, as in DDP) or kKeepParent");
  if (start_step < 0)
    throw InvalidArgument(fmt::format("Options.start_step: expected >= 0, got {}", start_step));
  if (message_bytes > (std::uint64_t{1} << 32))
    throw InvalidArgument(
        fmt::format("Options.message_bytes: expected at most 4 GiB, got {}", message_bytes));
  requireTimeout("shutdown_timeout", shutdown_timeout, true);
}

int Options::resolvedThreadsPerWorker(int workers_on_these_cores) const {
  if (threads_per_worker > 0) return threads_per_worker;
  return std::max(1, availableCores() / std::max(1, workers_on_these_cores));
}

}  // namespace gradagg
