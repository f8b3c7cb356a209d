#include <gradagg/options.h>

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <thread>
#include <type_traits>

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
    throw InvalidArgument(
        fmt::format("Options.threads_per_worker: expected >= 0 (0 = cores / workers), got {}",
                    threads_per_worker));
  if (parent_threads < 0)
    throw InvalidArgument(fmt::format(
        "Options.parent_threads: expected >= 0 (0 = leave as is), got {}", parent_threads));
  if (step_timeout.count() <= 0)
    throw InvalidArgument(
        fmt::format("Options.step_timeout: expected > 0 ms, got {} ms", step_timeout.count()));
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
  if (nodes.timeout.count() <= 0)
    throw InvalidArgument(
        fmt::format("Options.nodes.timeout: expected > 0 ms, got {} ms", nodes.timeout.count()));
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
  if (shutdown_timeout.count() < 0)
    throw InvalidArgument(fmt::format("Options.shutdown_timeout: expected >= 0 ms, got {} ms",
                                      shutdown_timeout.count()));
}

namespace {
std::string firstSlurmHost(const std::string& list) {
  // "node[01-04,07],gpu5" -> "node01"; "a,b" -> "a"; "host" -> "host".
  std::size_t end = 0;
  int depth = 0;
  for (; end < list.size(); ++end) {
    if (list[end] == '[') ++depth;
    if (list[end] == ']') --depth;
    if (list[end] == ',' && depth == 0) break;
  }
  const std::string first = list.substr(0, end);
  const std::size_t open = first.find('[');
  if (open == std::string::npos) return first;
  const std::size_t close = first.find(']', open);
  const std::string range = first.substr(open + 1, close - open - 1);
  const std::string start = range.substr(0, range.find_first_of(",-"));
  return first.substr(0, open) + start +
         (close == std::string::npos ? "" : first.substr(close + 1));
}
}  // namespace

NodeOptions NodeOptions::fromEnvironment(NodeOptions o) {
  auto set = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0';
  };
  auto text = [&](const char* name, std::string& out) {
    if (set(name)) out = std::getenv(name);
  };
  auto number = [&](const char* name, auto& out) {
    if (!set(name)) return false;
    const char* v = std::getenv(name);
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v, &end, 10);
    using T = std::remove_reference_t<decltype(out)>;
    if (end == v || *end != '\0' || errno == ERANGE || n < std::numeric_limits<T>::min() ||
        n > std::numeric_limits<T>::max())
      throw InvalidArgument(
          fmt::format("environment variable {}: expected an integer, got '{}'", name, v));
    out = static_cast<T>(n);
    return true;
  };
  // Launchers, weakest first; gradagg's own variables last, so they win.
  // Slurm (srun, one task per node): SLURM_NNODES, SLURM_NODEID, the first host
  // of SLURM_JOB_NODELIST as node 0.
  number("SLURM_NNODES", o.nodes);
  number("SLURM_NODEID", o.node_rank);
  if (set("SLURM_JOB_NODELIST")) o.master_addr = firstSlurmHost(std::getenv("SLURM_JOB_NODELIST"));
  // torchrun --nnodes N --nproc-per-node 1: each node's one process is a node
  // parent. GROUP_WORLD_SIZE / GROUP_RANK (NODE_RANK elsewhere), MASTER_ADDR,
  // MASTER_PORT; with its static rendezvous its agent serves the store.
  number("GROUP_WORLD_SIZE", o.nodes);
  number("NODE_RANK", o.node_rank);
  number("GROUP_RANK", o.node_rank);
  text("MASTER_ADDR", o.master_addr);
  number("MASTER_PORT", o.master_port);
  if (set("TORCHELASTIC_USE_AGENT_STORE"))
    o.external_store = std::string(std::getenv("TORCHELASTIC_USE_AGENT_STORE")) == "True";
  int attempt = 0;
  if (number("TORCHELASTIC_RESTART_COUNT", attempt))
    o.store_prefix = fmt::format("gradagg/attempt_{}", attempt);
  // gradagg's own.
  number("GRADAGG_NNODES", o.nodes);
  number("GRADAGG_NODE_RANK", o.node_rank);
  text("GRADAGG_STORE_PATH", o.store_path);
  text("GRADAGG_SOCKET_IFNAME", o.interface);
  long long timeout_ms = o.timeout.count();
  number("GRADAGG_NODE_TIMEOUT_MS", timeout_ms);
  o.timeout = std::chrono::milliseconds(timeout_ms);
  number("GRADAGG_CHECKSUM_INTERVAL", o.checksum_interval);
  if (set("GRADAGG_COMPRESSION")) {
    const std::string v = std::getenv("GRADAGG_COMPRESSION");
    if (v == "none") {
      o.compression = Compression::kNone;
    } else if (v == "bf16") {
      o.compression = Compression::kBFloat16;
    } else {
      throw InvalidArgument(fmt::format(
          "environment variable GRADAGG_COMPRESSION: expected none or bf16, got '{}'", v));
    }
  }
  auto bytes = [&](const char* name, std::uint64_t& out) {
    long long v = static_cast<long long>(out);
    if (!number(name, v)) return;
    if (v <= 0)
      throw InvalidArgument(fmt::format("environment variable {}: expected > 0, got {}", name, v));
    out = static_cast<std::uint64_t>(v);
  };
  bytes("GRADAGG_BUCKET_BYTES", o.bucket_bytes);
  bytes("GRADAGG_FIRST_BUCKET_BYTES", o.first_bucket_bytes);
  int overlap = o.overlap ? 1 : 0;
  if (number("GRADAGG_OVERLAP", overlap)) {
    if (overlap != 0 && overlap != 1)
      throw InvalidArgument(
          fmt::format("environment variable GRADAGG_OVERLAP: expected 0 or 1, got {}", overlap));
    o.overlap = overlap == 1;
  }
  return o;
}

NodeOptions NodeOptions::fromEnvironment() { return fromEnvironment(NodeOptions{}); }

int Options::resolvedThreadsPerWorker(int workers_on_these_cores) const {
  if (threads_per_worker > 0) return threads_per_worker;
  return std::max(1, availableCores() / std::max(1, workers_on_these_cores));
}

}  // namespace gradagg
