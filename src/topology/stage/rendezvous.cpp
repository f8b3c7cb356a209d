#include "topology/stage/rendezvous.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <gradagg/errors.h>

#include "runtime/text_map.h"

namespace gradagg::detail {

void requireWideDtypes(const ModelBinding& binding) {
  for (const TensorEntry& p : binding.params())
    if (p.dtype != at::kFloat && p.dtype != at::kDouble)
      throw InvalidArgument(fmt::format(
          "parameter '{}' is {}: across nodes gradagg serves float32 and float64 parameters "
          "only (one node serves bfloat16 and float16 too)",
          p.name, c10::toString(p.dtype)));
}

namespace {

std::string describeLayout(const ModelBinding& binding) {
  std::string out;
  for (const auto* list : {&binding.params(), &binding.buffers()}) {
    for (const TensorEntry& e : *list)
      out += fmt::format("{} {} {}\n", list == &binding.params() ? "parameter" : "buffer", e.name,
                         describeShape(e.sizes, e.dtype));
  }
  return out;
}

// The first line where two layout descriptions differ.
std::string firstDifference(const std::string& a, const std::string& b) {
  std::size_t pa = 0, pb = 0;
  for (;;) {
    const std::size_t ea = a.find('\n', pa), eb = b.find('\n', pb);
    const std::string la = pa < a.size() ? a.substr(pa, ea - pa) : "(nothing)";
    const std::string lb = pb < b.size() ? b.substr(pb, eb - pb) : "(nothing)";
    if (la != lb) return fmt::format("'{}' against '{}'", la, lb);
    if (ea == std::string::npos || eb == std::string::npos) return "the same lines";
    pa = ea + 1;
    pb = eb + 1;
  }
}

// What tells which nodes share this node's cores: the kernel's boot id (one per
// machine, shared by its containers and network namespaces), the CPUs this
// process may run on, and this node's worker count.
std::string hostIdentity(int workers) {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  if (boot.empty()) {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    boot = host;
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  std::string cpus;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus += fmt::format("{} ", c);
  return fmt::format("{}\n{}\n{}", boot, cpus, workers);
}

struct HostIdentity {
  std::string boot;
  std::set<int> cpus;
  int workers = 0;
};

HostIdentity parseHostIdentity(const std::string& id) {
  HostIdentity h;
  std::istringstream in(id);
  std::string cpus;
  std::getline(in, h.boot);
  std::getline(in, cpus);
  in >> h.workers;
  std::istringstream list(cpus);
  for (int c; list >> c;) h.cpus.insert(c);
  return h;
}

// Where node `me` sits, from every node's hostIdentity(): its workers' offset
// among all, and the nodes (with their workers) that run on its cores.
Placement placementAmong(const std::vector<std::string>& ids, int me) {
  Placement p;
  p.node = me;
  p.nodes = static_cast<int>(ids.size());
  p.host_nodes = 0;
  const HostIdentity mine = parseHostIdentity(ids[static_cast<std::size_t>(me)]);
  for (int r = 0; r < p.nodes; ++r) {
    const HostIdentity other = parseHostIdentity(ids[static_cast<std::size_t>(r)]);
    if (r < me) p.worker_offset += other.workers;
    p.global_workers += other.workers;
    const bool overlap = std::any_of(other.cpus.begin(), other.cpus.end(),
                                     [&](int c) { return mine.cpus.count(c) > 0; });
    if (other.boot == mine.boot && (overlap || other.cpus.empty() || mine.cpus.empty())) {
      ++p.host_nodes;
      p.host_workers += other.workers;
    }
  }
  p.host_nodes = std::max(p.host_nodes, 1);
  p.host_workers = std::max(p.host_workers, mine.workers);
  return p;
}

// What this node says it starts from (the agreement fields), by field name.
std::map<std::string, std::string> agreementOf(const Options& options) {
  const NodeOptions& o = options.nodes;
  std::map<std::string, std::string> fields;
  fields["start_step"] = std::to_string(options.start_step);
  // The workers' dropout streams derive from it: one seed for the job, given
  // alike to every node, or node 0's torch seed where none is given.
  // (Always compared: whether the seed is exchanged below must be the same everywhere.)
  fields["seed"] = options.seed ? std::to_string(*options.seed) : "unset (node 0's torch seed)";
  // The step's collectives must have the same shape everywhere.
  fields["compression"] = o.compression == Compression::kBFloat16 ? "bf16" : "none";
  fields["bucket_bytes"] = std::to_string(o.bucket_bytes);
  fields["first_bucket_bytes"] = std::to_string(o.first_bucket_bytes);
  fields["checksum_interval"] = std::to_string(o.checksum_interval);  // a collective every N steps
  fields["buffers"] = options.buffers == BufferSync::kFromRank0 ? "rank0"  // a collective or not
                      : options.buffers == BufferSync::kMean    ? "mean"
                                                                : "keep";
  // The step's outcome must be the same everywhere: its weights and what a NaN does.
  fields["weighting"] = options.weighting == Weighting::kEqual ? "equal" : "samples";
  fields["non_finite"] = options.non_finite == NonFinitePolicy::kSkipStep ? "skip" : "raise";
  fields["max_consecutive_skips"] = std::to_string(options.max_consecutive_skips);
  fields["resume_identity"] =
      o.resume_identity.empty() ? "(a fresh start)" : "checkpoint " + o.resume_identity;
  for (const auto& [key, value] : o.must_match) fields["must_match[" + key + "]"] = value;
  return fields;
}

// Every node's agreement fields must be node 0's: else an InvalidArgument (the
// same on every node, since every node sees every node's fields) naming the
// first field that differs and what each node has.
void requireAgreement(const std::vector<std::string>& all, int me) {
  std::vector<std::map<std::string, std::string>> nodes;
  for (const std::string& text : all) {
    auto fields = decodeTextMap(text);
    if (!fields) throw InternalError("gradagg: a node sent a malformed start-up agreement");
    nodes.push_back(std::move(*fields));
  }
  std::set<std::string> names;
  for (const auto& n : nodes)
    for (const auto& [k, v] : n) names.insert(k);
  for (const std::string& name : names) {
    std::vector<std::string> values;
    bool differ = false;
    for (const auto& n : nodes) {
      const auto it = n.find(name);
      values.push_back(it == n.end() ? "(not set)" : it->second);
      differ = differ || values.back() != values.front();
    }
    if (!differ) continue;
    std::string each;
    for (std::size_t r = 0; r < values.size(); ++r)
      each += fmt::format("{}node {}: {}", r == 0 ? "" : ", ", r, values[r]);
    throw InvalidArgument(fmt::format(
        "gradagg: the nodes disagree on {} before the first step ({}; this is node {}): start "
        "every node with the same settings and from the same checkpoint",
        name, each, me));
  }
}

}  // namespace

Placement rendezvous(NodeGroup& group, const Options& options, const ModelBinding& binding) {
  const auto layouts = group.exchange("layout", describeLayout(binding));
  for (int r = 0; r < group.size(); ++r) {
    if (layouts[r] == layouts[0]) continue;
    throw InvalidArgument(
        fmt::format("gradagg: node {} has a different model from node 0 (this is node {}): {}", r,
                    group.rank(), firstDifference(layouts[r], layouts[0])));
  }
  requireAgreement(group.exchange("agreement", encodeTextMap(agreementOf(options))), group.rank());
  Placement p = placementAmong(group.exchange("host", hostIdentity(options.workers)), group.rank());
  p.seed = options.seed ? *options.seed
                        : std::stoull(group.exchange("seed", std::to_string(parentTorchSeed()))[0]);
  return p;
}

void broadcastInitialValues(NodeGroup& group, ModelBinding& binding) {
  for (TensorEntry& e : binding.params()) {
    at::Tensor v = viewAt(e, binding.paramRegion());
    group.broadcastFromNode0(v, "broadcasting the initial parameters");
  }
  for (TensorEntry& e : binding.buffers()) {
    at::Tensor v = viewAt(e, binding.bufferRegion());
    group.broadcastFromNode0(v, "broadcasting the initial buffers");
  }
}

}  // namespace gradagg::detail
