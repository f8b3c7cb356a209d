// NodeOptions from the environment: the variables of the launchers a multi-node
// job starts under (torchrun, Slurm) and gradagg's own.
#include <gradagg/options.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include <gradagg/errors.h>

namespace gradagg {

namespace {
// The first host of a Slurm host list: its first entry at bracket depth 0, each
// bracket replaced by its first number. "node[01-04,07],gpu5" -> "node01";
// "rack[1-2]-n[01-04]" -> "rack1-n01"; "a,b" -> "a"; "host" -> "host".
std::string firstSlurmHost(const std::string& list) {
  std::string first;
  int depth = 0;
  bool first_of_range = false;  // inside a bracket, before its first ',' or '-'
  for (const char c : list) {
    if (c == ',' && depth == 0) break;
    if (c == '[') {
      ++depth;
      first_of_range = true;
    } else if (c == ']') {
      --depth;
    } else if (depth > 0 && (c == ',' || c == '-')) {
      first_of_range = false;
    } else if (depth == 0 || first_of_range) {
      first += c;
    }
  }
  return first;
}

// The environment's variables, read with the checks every launcher's need.
struct Environment {
  static const char* get(const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  }
  static bool text(const char* name, std::string& out) {
    const char* v = get(name);
    if (v != nullptr) out = v;
    return v != nullptr;
  }
  // An integer variable into `out` (when set); InvalidArgument naming it otherwise.
  template <typename T>
  static bool number(const char* name, T& out) {
    const char* v = get(name);
    if (v == nullptr) return false;
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v, &end, 10);
    if (end == v || *end != '\0' || errno == ERANGE || n < std::numeric_limits<T>::min() ||
        n > std::numeric_limits<T>::max())
      throw InvalidArgument(
          fmt::format("environment variable {}: expected an integer, got '{}'", name, v));
    out = static_cast<T>(n);
    return true;
  }
  // Integer fields, each from its variable in turn (a later one wins).
  static void integers(std::initializer_list<std::pair<const char*, int*>> fields) {
    for (const auto& [name, field] : fields) number(name, *field);
  }
  static void bytes(const char* name, std::uint64_t& out) {
    long long v = static_cast<long long>(out);
    if (!number(name, v)) return;
    if (v <= 0)
      throw InvalidArgument(fmt::format("environment variable {}: expected > 0, got {}", name, v));
    out = static_cast<std::uint64_t>(v);
  }
};

// torch.distributed's env:// convention (init_process_group reads WORLD_SIZE,
// RANK, MASTER_ADDR, MASTER_PORT): each process is one node's parent.
void fromEnvInit(NodeOptions& o) {
  Environment::integers({{"WORLD_SIZE", &o.nodes}, {"RANK", &o.node_rank}});
}

// The most tasks a node of a Slurm step runs: SLURM_STEP_TASKS_PER_NODE is a
// list such as "2(x3),1" (2 tasks on each of 3 nodes, then 1).
int mostSlurmTasksPerNode(const std::string& list) {
  int most = 0;
  std::size_t at = 0;
  while (at < list.size()) {
    char* end = nullptr;
    const long n = std::strtol(list.c_str() + at, &end, 10);
    if (end == list.c_str() + at) return 0;  // not Slurm's format: nothing to refuse
    most = std::max(most, static_cast<int>(std::min<long>(n, std::numeric_limits<int>::max())));
    const std::size_t comma = list.find(',', at);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return most;
}

[[noreturn]] void refuseSlurmTasksPerNode(const std::string& what) {
  throw InvalidArgument(fmt::format(
      "environment {}: gradagg runs one process per node (it forks its own workers); start it "
      "with srun --ntasks-per-node 1",
      what));
}

// Slurm (srun, one task per node): SLURM_NNODES (the step's SLURM_STEP_NUM_NODES
// where set), SLURM_NODEID (the step's node index) and, as node 0, the first host
// of SLURM_STEP_NODELIST (the step's nodes, which SLURM_NODEID counts), else of
// SLURM_JOB_NODELIST. Several tasks per node are refused: the step's
// SLURM_STEP_TASKS_PER_NODE above 1 where srun sets it, else the job's
// SLURM_NTASKS_PER_NODE above 1 or SLURM_NTASKS above SLURM_NNODES.
void fromSlurm(NodeOptions& o) {
  Environment::integers({{"SLURM_NNODES", &o.nodes},
                         {"SLURM_STEP_NUM_NODES", &o.nodes},
                         {"SLURM_NODEID", &o.node_rank}});
  const char* list = Environment::get("SLURM_STEP_NODELIST");
  if (list == nullptr) list = Environment::get("SLURM_JOB_NODELIST");
  if (list != nullptr) o.master_addr = firstSlurmHost(list);

  // The step's own layout where srun gives it (a job's SLURM_NTASKS_PER_NODE is
  // inherited by a step that runs fewer tasks); else the job's.
  if (const char* step = Environment::get("SLURM_STEP_TASKS_PER_NODE")) {
    if (mostSlurmTasksPerNode(step) > 1)
      refuseSlurmTasksPerNode(fmt::format("variable SLURM_STEP_TASKS_PER_NODE={}", step));
    return;
  }
  int per_node = 1;
  if (Environment::number("SLURM_NTASKS_PER_NODE", per_node) && per_node > 1)
    refuseSlurmTasksPerNode(fmt::format("variable SLURM_NTASKS_PER_NODE={}", per_node));
  int tasks = 0;
  int nodes = 0;
  if (Environment::number("SLURM_NTASKS", tasks) && Environment::number("SLURM_NNODES", nodes) &&
      tasks > nodes)
    refuseSlurmTasksPerNode(
        fmt::format("variables SLURM_NTASKS={} and SLURM_NNODES={}", tasks, nodes));
}

// torchrun --nnodes N --nproc_per_node 1: each node's one process is a node
// parent. GROUP_WORLD_SIZE / GROUP_RANK (NODE_RANK elsewhere), MASTER_ADDR,
// MASTER_PORT; with its static rendezvous its agent serves the store.
void fromTorchrun(NodeOptions& o) {
  int local_world = 1;
  if (Environment::number("LOCAL_WORLD_SIZE", local_world) && local_world > 1)
    throw InvalidArgument(fmt::format(
        "environment variable LOCAL_WORLD_SIZE={}: gradagg runs one process per node (it forks "
        "its own workers); start it with torchrun --nproc_per_node 1",
        local_world));
  Environment::integers({{"GROUP_WORLD_SIZE", &o.nodes},
                         {"NODE_RANK", &o.node_rank},
                         {"GROUP_RANK", &o.node_rank},
                         {"MASTER_PORT", &o.master_port}});
  Environment::text("MASTER_ADDR", o.master_addr);
  std::string agent_store;
  if (Environment::text("TORCHELASTIC_USE_AGENT_STORE", agent_store))
    o.external_store = agent_store == "True";
  int attempt = 0;
  if (Environment::number("TORCHELASTIC_RESTART_COUNT", attempt))
    o.store_prefix = fmt::format("gradagg/attempt_{}", attempt);
}

// gradagg's own (docs/multinode.md).
void fromGradagg(NodeOptions& o) {
  Environment::integers({{"GRADAGG_NNODES", &o.nodes},
                         {"GRADAGG_NODE_RANK", &o.node_rank},
                         {"GRADAGG_CHECKSUM_INTERVAL", &o.checksum_interval}});
  Environment::text("GRADAGG_STORE_PATH", o.store_path);
  Environment::text("GRADAGG_SOCKET_IFNAME", o.interface);
  Environment::text("GRADAGG_JOB_TOKEN", o.token);
  long long timeout_ms = o.timeout.count();
  Environment::number("GRADAGG_NODE_TIMEOUT_MS", timeout_ms);
  o.timeout = std::chrono::milliseconds(timeout_ms);
  std::string compression;
  if (Environment::text("GRADAGG_COMPRESSION", compression)) {
    if (compression != "none" && compression != "bf16")
      throw InvalidArgument(
          fmt::format("environment variable GRADAGG_COMPRESSION: expected none or bf16, got '{}'",
                      compression));
    o.compression = compression == "bf16" ? Compression::kBFloat16 : Compression::kNone;
  }
  Environment::bytes("GRADAGG_BUCKET_BYTES", o.bucket_bytes);
  Environment::bytes("GRADAGG_FIRST_BUCKET_BYTES", o.first_bucket_bytes);
  int overlap = o.overlap ? 1 : 0;
  if (Environment::number("GRADAGG_OVERLAP", overlap)) {
    if (overlap != 0 && overlap != 1)
      throw InvalidArgument(
          fmt::format("environment variable GRADAGG_OVERLAP: expected 0 or 1, got {}", overlap));
    o.overlap = overlap == 1;
  }
}

}  // namespace

// Launchers, weakest first; gradagg's own variables last, so they win.
NodeOptions NodeOptions::fromEnvironment(NodeOptions o) {
  fromEnvInit(o);
  fromSlurm(o);
  fromTorchrun(o);
  fromGradagg(o);
  return o;
}

NodeOptions NodeOptions::fromEnvironment() { return fromEnvironment(NodeOptions{}); }

}  // namespace gradagg
