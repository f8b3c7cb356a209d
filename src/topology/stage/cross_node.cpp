#include "topology/stage/cross_node.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <gradagg/errors.h>

#include "topology/stage/rendezvous.h"
#include "topology/stage/status_tail.h"

namespace gradagg::detail {

namespace {
std::uint64_t fnv1a(const std::byte* p, std::size_t n, std::uint64_t h) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<std::uint8_t>(p[i])) * 1099511628211ull;
  return h;
}
}  // namespace

CrossNode::CrossNode(const Options& options, ModelBinding& binding)
    : group_((requireWideDtypes(binding), options.nodes)),
      binding_(binding),
      plan_(planBuckets(binding, options.nodes.first_bucket_bytes, options.nodes.bucket_bytes,
                        options.nodes.overlap)),
      compression_(options.nodes.compression),
      checksum_interval_(options.nodes.checksum_interval),
      gather_buffers_(options.buffers == BufferSync::kFromRank0),
      placement_(rendezvous(group_, options, binding)),
      row_map_(rowMap(binding.params())) {}

std::uint64_t CrossNode::tailBytes() const { return statusBytes(binding_.params().size()); }

void CrossNode::attach(const SegmentMap& segment) {
  segment_ = segment;
  broadcastInitialValues(group_, binding_);
  // The pieces that cross, each bound once per result region. With one bucket
  // per dtype run (BucketPlan::whole) they go in offset order and the status
  // rides at the end of the last (adjacent to it): one collective per run.
  // Otherwise the buckets go in their crossing order and the status alone
  // after them; likewise with compression, so the status stays exact.
  const std::uint64_t param_bytes = segment_.layout.sizes.param_bytes;
  std::vector<std::pair<ByteRange, c10::ScalarType>> units;
  units.reserve(static_cast<std::size_t>(plan_.size()));
  for (int b = 0; b < plan_.size(); ++b) units.emplace_back(plan_.ranges[b], plan_.dtypes[b]);
  if (plan_.whole()) std::reverse(units.begin(), units.end());
  status_dtype_ = plan_.size() > 0 ? plan_.dtypes.front() : c10::ScalarType::Double;
  const std::uint64_t status_end =
      param_bytes + c10::elementSize(status_dtype_) * (kStatusFields + binding_.params().size());
  const bool status_rides = compression_ == Compression::kNone && plan_.whole();
  if (units.empty() || !status_rides)
    units.emplace_back(ByteRange{param_bytes, param_bytes}, status_dtype_);
  units.back().first.end = status_end;  // the status: riding, or on its own
  for (std::size_t u = 0; u < units.size(); ++u)
    pieces_.push_back(bindPiece(units[u].first, units[u].second, u + 1 == units.size()));
  group_.endRendezvous();
}

CrossNode::Piece CrossNode::bindPiece(ByteRange range, c10::ScalarType dtype, bool status) {
  const auto count = static_cast<std::int64_t>((range.end - range.begin) / c10::elementSize(dtype));
  Piece piece;
  for (int i = 0; i < 2; ++i)
    piece.view[i] =
        at::from_blob(segment_.result(i) + range.begin, {count}, at::TensorOptions().dtype(dtype));
  if (compression_ == Compression::kBFloat16 && dtype == at::kFloat && !status) {
    piece.wire = at::empty({count}, at::kBFloat16);
    const int handle = group_.bindSum(piece.wire);
    for (int i = 0; i < 2; ++i) piece.sum[i] = {handle};
    wire_bytes_ += piece.wire.nbytes();
  } else {
    for (int i = 0; i < 2; ++i) piece.sum[i] = {group_.bindSum(piece.view[i])};
    wire_bytes_ += range.end - range.begin;
  }
  return piece;
}

void CrossNode::beforeStep(std::int64_t step) {
  if (checksum_interval_ > 0 && step > 0 && step % checksum_interval_ == 0) checkParameters(step);
}

Reduced CrossNode::reduce(const Contribution& local, int result) {
  std::byte* status = segment_.tail(result);
  const bool wide = status_dtype_ == c10::ScalarType::Double;
  const std::size_t params = binding_.params().size();
  if (wide)
    writeStatus<double>(status, local, params);
  else
    writeStatus<float>(status, local, params);
  // A node whose workers failed sends whatever its result holds: every node
  // then sees the failure in the status and discards the sums.
  const int overlapped = overlapped_;
  const int sent = awaitSent();
  for (std::size_t i = static_cast<std::size_t>(sent); i < pieces_.size(); ++i)
    send(pieces_[i], result);
  all_has_grad_.resize(params);
  const NodeStatus all = wide ? readStatus<double>(status, all_has_grad_.data(), params)
                              : readStatus<float>(status, all_has_grad_.data(), params);
  Reduced out;
  out.failed = all.failed;
  out.non_finite = all.non_finite;
  out.sums = all.sums;
  out.result = result;
  out.has_grad = all_has_grad_;
  out.wire.bytes = wire_bytes_;
  out.wire.collectives = static_cast<int>(pieces_.size());
  out.wire.overlapped = overlapped;
  if (out.failed || out.non_finite) return out;
  out.sums.metrics = sumMetrics(local.sums.metrics, all.metric_nodes, all.metric_names);
  out.wire.collectives += out.sums.metrics.count > 0 ? 1 : 0;
  out.rows = unionRows(local.rows, out.has_grad);
  out.wire.collectives += out.rows.empty() ? 0 : 1;
  if (out.sums.weight_total > 0) divide(result, out.has_grad, out.sums.weight_total);  // 0: refused
  return out;
}

MetricSums CrossNode::sumMetrics(const MetricSums& local, int nodes, int names) {
  // Every node whose workers returned metrics returns the same names (each
  // node's parent checked its own against its first step). A node without
  // (its workers had no samples) takes part with zeros. Whether the nodes
  // agree is decided from sums only, so that every node decides alike (a node
  // that went on alone would wait in a collective nobody else joins): with
  // counts c_i on the `nodes` nodes that have any, all are equal exactly when
  // nodes * sum(c_i^2) == (sum c_i)^2; the squares cross with the values.
  MetricSums out;
  if (nodes == 0) return out;
  constexpr int kSquares = ShardResult::kMaxMetrics;  // the slot after the values
  if (!metrics_.defined()) metrics_ = at::zeros({kSquares + 1}, at::kDouble);
  double* values = metrics_.data_ptr<double>();
  for (int i = 0; i < kSquares; ++i) values[i] = i < local.count ? local.values[i] : 0;
  values[kSquares] = static_cast<double>(local.count) * local.count;
  group_.allreduceSum(metrics_, "the cross-node metric allreduce");
  if (static_cast<double>(nodes) * values[kSquares] != static_cast<double>(names) * names)
    throw InvalidArgument(fmt::format(
        "gradagg: the nodes' shard functions return different metrics (node {}: {} names; "
        "{} names over the {} nodes that returned any); every node must return the same names",
        group_.rank(), local.count, names, nodes));
  out.count = names / nodes;
  for (int i = 0; i < out.count; ++i) out.values[i] = values[i];
  return out;
}

c10::ArrayRef<std::uint8_t> CrossNode::unionRows(c10::ArrayRef<std::uint8_t> local,
                                                 c10::ArrayRef<std::uint8_t> has_grad) {
  std::int64_t count = 0;
  for (std::size_t k = 0; k < has_grad.size(); ++k)
    if (sparseOnly(has_grad[k])) count += row_map_.rows[k];
  if (count == 0) return {};
  // This node's rows of the parameters sparse everywhere (zeros where its own
  // workers gave none, or a dense gradient), as int32 counts that sum over
  // the nodes.
  at::Tensor rows = at::zeros({count}, at::kInt);
  std::int32_t* packed = rows.data_ptr<std::int32_t>();
  std::int64_t pos = 0;
  for (std::size_t k = 0; k < has_grad.size(); ++k) {
    if (!sparseOnly(has_grad[k])) continue;
    if (!local.empty())
      for (std::int64_t i = 0; i < row_map_.rows[k]; ++i)
        packed[pos + i] = local[row_map_.offset[k] + static_cast<std::uint64_t>(i)];
    pos += row_map_.rows[k];
  }
  group_.allreduceSum(rows, "the cross-node allreduce of the sparse gradients' rows");
  all_rows_.assign(row_map_.bytes, 0);
  pos = 0;
  for (std::size_t k = 0; k < has_grad.size(); ++k) {
    if (!sparseOnly(has_grad[k])) continue;
    std::uint8_t* touched = all_rows_.data() + row_map_.offset[k];
    for (std::int64_t i = 0; i < row_map_.rows[k]; ++i) touched[i] = packed[pos + i] > 0 ? 1 : 0;
    pos += row_map_.rows[k];
  }
  return all_rows_;
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
  if (plan_.early() == 0) return 0;
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

void CrossNode::divide(int result, c10::ArrayRef<std::uint8_t> has_grad, double total) {
  std::byte* out = segment_.result(result);
  const auto& params = binding_.params();
  for (std::size_t k = 0; k < params.size(); ++k) {
    if (!has_grad[k]) continue;
    scaleInPlace(elementTypeOf(params[k].dtype), out + params[k].offset,
                 static_cast<std::size_t>(params[k].tensor.numel()), 1.0 / total);
  }
}

const std::byte* CrossNode::firstBuffers(const std::byte* local) {
  const std::uint64_t bytes = segment_.layout.sizes.buffer_bytes;
  if (!gather_buffers_ || bytes == 0) return local;  // no buffers: nothing to share
  if (!first_buffers_.defined()) {
    first_buffers_ = at::empty({static_cast<std::int64_t>(bytes)}, at::kByte);
    for (const TensorEntry& e : binding_.buffers())
      first_buffer_views_.push_back(viewAt(e, static_cast<std::byte*>(first_buffers_.data_ptr())));
  }
  auto* copy = static_cast<std::byte*>(first_buffers_.data_ptr());
  if (group_.rank() == 0)
    std::memcpy(copy, local, bytes);
  else
    std::memset(copy, 0, bytes);
  for (at::Tensor& b : first_buffer_views_)
    group_.allreduceSum(b, "the cross-node buffer allreduce");
  return copy;
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
