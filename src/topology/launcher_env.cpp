// NodeOptions from the environment: the variables of the launchers a multi-node
// job starts under (torchrun, Slurm) and gradagg's own.
#include <gradagg/options.h>

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include <fmt/format.h>

#include <gradagg/errors.h>

namespace gradagg {

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

}  // namespace gradagg
