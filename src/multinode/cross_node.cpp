#include "multinode/cross_node.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <gradagg/errors.h>

#include "core/text_map.h"

namespace gradagg::detail {

namespace {

// The cross-node collective carries float32 and float64 runs only: a bf16 or
// fp16 parameter is refused before the rendezvous, so every node fails alike.
void requireWideDtypes(const ModelBinding& binding) {
  for (const TensorEntry& p : binding.params())
    if (p.dtype != at::kFloat && p.dtype != at::kDouble)
      throw InvalidArgument(fmt::format(
          "parameter '{}' is {}: across nodes gradagg serves float32 and float64 parameters "
          "only (one node serves bfloat16 and float16 too)",
          p.name, c10::toString(p.dtype)));
}

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
  p.normalize = false;
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

// What this node says it starts from (NodeOptions' agreement fields), by field name.
std::map<std::string, std::string> agreementOf(const NodeOptions& o) {
  std::map<std::string, std::string> fields;
  fields["start_step"] = std::to_string(o.start_step);
  // The step's collectives must have the same shape everywhere.
  fields["compression"] = o.compression == Compression::kBFloat16 ? "bf16" : "none";
  fields["bucket_bytes"] = std::to_string(o.bucket_bytes);
  fields["first_bucket_bytes"] = std::to_string(o.first_bucket_bytes);
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

std::uint64_t fnv1a(const std::byte* p, std::size_t n, std::uint64_t h) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<std::uint8_t>(p[i])) * 1099511628211ull;
  return h;
}

}  // namespace

CrossNode::CrossNode(const NodeOptions& options, BufferSync buffers, ModelBinding& binding,
                     const SegmentMap& segment, int workers, const BucketPlan& plan)
    : group_((requireWideDtypes(binding), options)),
      binding_(binding),
      segment_(segment),
      checksum_interval_(options.checksum_interval),
      gather_buffers_(buffers == BufferSync::kFromRank0) {
  // The same model everywhere, checked by comparing layouts through the store.
  const std::string mine = describeLayout(binding);
  const auto all = group_.exchange("layout", mine);
  for (int r = 0; r < group_.size(); ++r) {
    if (all[r] == all[0]) continue;
    throw InvalidArgument(
        fmt::format("gradagg: node {} has a different model from node 0 (this is node {}): {}", r,
                    group_.rank(), firstDifference(all[r], all[0])));
  }
  requireAgreement(group_.exchange("agreement", encodeTextMap(agreementOf(options))),
                   group_.rank());
  placement_ = placementAmong(group_.exchange("host", hostIdentity(workers)), group_.rank());
  // The same initial values everywhere: node 0's.
  for (TensorEntry& e : binding.params()) {
    at::Tensor v = viewAt(e, binding.paramRegion());
    group_.broadcastFromNode0(v, "broadcasting the initial parameters");
  }
  for (TensorEntry& e : binding.buffers()) {
    at::Tensor v = viewAt(e, binding.bufferRegion());
    group_.broadcastFromNode0(v, "broadcasting the initial buffers");
    slot0_buffers_.push_back(viewAt(e, segment_.slotBuffers(0)));
  }
  // The pieces that cross, each bound once per result region. With one bucket
  // per dtype run (BucketPlan::whole) they go in offset order and the status
  // rides at the end of the last (adjacent to it): one collective per run.
  // Otherwise the buckets go in their crossing order and the status alone
  // after them; likewise with compression, so the status stays exact.
  const auto& params = binding.params();
  const std::uint64_t param_bytes = segment_.layout.sizes.param_bytes;
  std::vector<std::pair<ByteRange, c10::ScalarType>> units;
  for (int b = 0; b < plan.size(); ++b) units.emplace_back(plan.ranges[b], plan.dtypes[b]);
  if (plan.whole()) std::reverse(units.begin(), units.end());
  early_ = plan.early();
  status_dtype_ = plan.size() > 0 ? plan.dtypes.front() : c10::ScalarType::Double;
  const std::uint64_t status_end =
      param_bytes + c10::elementSize(status_dtype_) * (kStatusFields + params.size());
  const bool status_rides = options.compression == Compression::kNone && plan.whole();
  if (units.empty() || !status_rides)
    units.emplace_back(ByteRange{param_bytes, param_bytes}, status_dtype_);
  units.back().first.end = status_end;  // the status: riding, or on its own
  auto view = [&](int i, const ByteRange& r, c10::ScalarType dtype) {
    const auto count = static_cast<std::int64_t>((r.end - r.begin) / c10::elementSize(dtype));
    return at::from_blob(segment_.result(i) + r.begin, {count}, at::TensorOptions().dtype(dtype));
  };
  for (std::size_t u = 0; u < units.size(); ++u) {
    const auto& [range, dtype] = units[u];
    Piece piece;
    for (int i = 0; i < 2; ++i) piece.view[i] = view(i, range, dtype);
    const bool status = u + 1 == units.size();
    if (options.compression == Compression::kBFloat16 && dtype == at::kFloat && !status) {
      piece.wire = at::empty({piece.view[0].numel()}, at::kBFloat16);
      const int handle = group_.bindSum(piece.wire);
      for (int i = 0; i < 2; ++i) piece.sum[i] = {handle};
      wire_bytes_ += piece.wire.nbytes();
    } else {
      for (int i = 0; i < 2; ++i) piece.sum[i] = {group_.bindSum(piece.view[i])};
      wire_bytes_ += range.end - range.begin;
    }
    pieces_.push_back(std::move(piece));
  }
  group_.endRendezvous();
}

void CrossNode::beforeStep(std::int64_t step) {
  if (checksum_interval_ > 0 && step > 0 && step % checksum_interval_ == 0) checkParameters(step);
}

namespace {
// A count as two parts that each stay exact in float32 (< 2^24) when summed.
constexpr std::int64_t kLow = 4096;
template <typename T>
void putCount(T* s, std::int64_t v) {
  s[0] = static_cast<T>(v / kLow);
  s[1] = static_cast<T>(v % kLow);
}
template <typename T>
std::int64_t getCount(const T* s) {
  return static_cast<std::int64_t>(s[0]) * kLow + static_cast<std::int64_t>(s[1]);
}
}  // namespace

template <typename T>
void CrossNode::writeStatus(T* s, const StepTotals& local,
                            const std::vector<std::uint8_t>& any_grad) const {
  s[0] = local.failed ? 1 : 0;
  s[1] = local.non_finite ? 1 : 0;
  putCount(s + 2, static_cast<std::int64_t>(local.weight_total));
  putCount(s + 4, local.samples);
  s[6] = static_cast<T>(local.loss);  // sum_i n_i loss_i: this node's workers' weights are n_i
  s[7] = 0;
  for (std::size_t k = 0; k < any_grad.size(); ++k) s[kStatusFields + k] = any_grad[k];
}

template <typename T>
StepTotals CrossNode::readStatus(const T* s, std::vector<std::uint8_t>& any_grad) const {
  StepTotals out;
  out.failed = s[0] > 0;
  out.non_finite = s[1] > 0;
  out.weight_total = static_cast<double>(getCount(s + 2));
  out.samples = getCount(s + 4);
  out.loss = out.weight_total > 0 ? static_cast<double>(s[6]) / out.weight_total : 0;
  for (std::size_t k = 0; k < any_grad.size(); ++k) any_grad[k] = s[kStatusFields + k] > 0 ? 1 : 0;
  return out;
}

StepTotals CrossNode::reduce(const StepTotals& local, std::vector<std::uint8_t>& any_grad,
                             int result) {
  std::byte* status = segment_.status(result);
  const bool wide = status_dtype_ == c10::ScalarType::Double;
  if (wide)
    writeStatus(reinterpret_cast<double*>(status), local, any_grad);
  else
    writeStatus(reinterpret_cast<float*>(status), local, any_grad);
  // A node whose workers failed sends whatever its result holds: every node
  // then sees the failure in the status and discards the sums.
  const int overlapped = overlapped_;
  const int sent = awaitSent();
  for (std::size_t i = static_cast<std::size_t>(sent); i < pieces_.size(); ++i)
    send(pieces_[i], result);
  const StepTotals all = wide ? readStatus(reinterpret_cast<const double*>(status), any_grad)
                              : readStatus(reinterpret_cast<const float*>(status), any_grad);
  StepTotals out = all;
  out.wire_bytes = wire_bytes_;
  out.collectives = static_cast<int>(pieces_.size());
  out.overlapped = overlapped;
  if (all.failed || all.non_finite) return out;
  divide(result, any_grad, all.weight_total);
  if (gather_buffers_) gatherBuffers();
  return out;
}

void CrossNode::send(Piece& piece, int result) {
  if (piece.wire.defined()) piece.wire.copy_(piece.view[result]);  // rounded to bf16
  group_.allreduceBound(piece.sum[result], "the cross-node allreduce of the step");
  if (piece.wire.defined()) piece.view[result].copy_(piece.wire);  // exact
}

CrossNode::~CrossNode() {
  if (!sender_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  sender_.join();
}

void CrossNode::sendEarly(int bucket, int result, bool overlapped) {
  // Started with the first bucket, not with the stage: the stage is built
  // before the workers are forked, and a thread being born during fork() can
  // leave a lock of the allocator held in the child for ever (seen under ASan:
  // a worker that never left 'starting'). Idle on its condition variable, it
  // holds none when a worker is forked again.
  if (!sender_.joinable()) sender_ = std::thread([this] { sendLoop(); });
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back({bucket, result});
    ++queued_;
    overlapped_ += overlapped ? 1 : 0;
  }
  wake_.notify_all();
}

// The sender thread: early buckets, in the order they were queued. After a
// failure it only counts them off (the step is lost; reduce() reports why).
void CrossNode::sendLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping
    const auto [bucket, result] = queue_.front();
    queue_.pop_front();
    const bool skip = error_ != nullptr;
    lock.unlock();
    std::exception_ptr error;
    if (!skip) {
      try {
        send(pieces_[static_cast<std::size_t>(bucket)], result);
      } catch (...) {
        error = std::current_exception();
      }
    }
    lock.lock();
    if (error) error_ = error;
    ++done_;
    wake_.notify_all();
  }
}

int CrossNode::awaitSent() {
  if (early_ == 0) return 0;
  std::unique_lock<std::mutex> lock(mutex_);
  wake_.wait(lock, [&] { return done_ == queued_; });
  const int sent = queued_;
  queued_ = done_ = overlapped_ = 0;
  if (error_) {
    const std::exception_ptr error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
  return sent;
}

int CrossNode::earlySent() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queued_;
}

void CrossNode::divide(int result, const std::vector<std::uint8_t>& any_grad, double total) {
  std::byte* out = segment_.result(result);
  const auto& params = binding_.params();
  for (std::size_t k = 0; k < params.size(); ++k) {
    if (!any_grad[k]) continue;
    scaleInPlace(elementTypeOf(params[k].dtype), out + params[k].offset,
                 static_cast<std::size_t>(params[k].tensor.numel()), 1.0 / total);
  }
}

void CrossNode::gatherBuffers() {
  for (at::Tensor& b : slot0_buffers_) {
    if (group_.rank() != 0) std::memset(b.data_ptr(), 0, b.nbytes());
    group_.allreduceSum(b, "the cross-node buffer allreduce");
  }
}

void CrossNode::checkParameters(std::int64_t step) {
  std::uint64_t h = 14695981039346656037ull;
  h = fnv1a(binding_.paramRegion(), segment_.layout.sizes.param_bytes, h);
  const auto sums = group_.allgather(static_cast<std::int64_t>(h), "the parameter checksum");
  std::vector<int> differ;
  for (int r = 0; r < group_.size(); ++r)
    if (sums[r] != sums[0]) differ.push_back(r);
  if (!differ.empty())
    throw NodeFailed(fmt::format("gradagg: before step {} the parameters of node(s) {} differ "
                                 "from node 0's (checksums); the nodes diverged",
                                 step, fmt::join(differ, ", ")),
                     group_.rank());
}

}  // namespace gradagg::detail
