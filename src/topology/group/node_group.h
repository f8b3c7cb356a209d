// NodeGroup: this node's parent in the group of node parents, on LibTorch's
// c10d ProcessGroupGloo (Debian libgloo-dev). c10d and gloo stay in topology/group/
// and topology/startup/: the stage above (topology/stage/) calls this class only.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <gradagg/options.h>

namespace gradagg::detail {

class NodeGroup {
 public:
  // Rendezvous with the other node parents (TCPStore or FileStore): the
  // admission (topology/startup/admission.h: this run's nodes, the job token), then
  // c10d's group and the step's gloo mesh. Throws NodeFailed when it does not
  // complete within options.timeout (the deadline of the start-up as a whole,
  // exchange() included, until endRendezvous()), Interrupted on
  // interruptWaits(), InvalidArgument for another job token or a MASTER_ADDR
  // that does not resolve.
  explicit NodeGroup(const NodeOptions& options);
  // A group that gave up on an operation still in flight in c10d's threads
  // leaves c10d's group to the process's exit instead of waiting for it.
  ~NodeGroup();
  NodeGroup(const NodeGroup&) = delete;
  NodeGroup& operator=(const NodeGroup&) = delete;

  // The start-up is over: the store is let go (node 0 stops serving it) and
  // exchange() can no longer be used.
  void endRendezvous();

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }

  // In place: the sum over all nodes (identical bits on every node). Throws NodeFailed.
  void allreduceSum(at::Tensor& t, const char* what);
  // The step's collective: sums over all nodes of tensors bound once (their
  // memory must stay put), run in the calling thread by gloo directly over this
  // group's own connections. On a small gradient c10d's hand-off to its worker
  // threads and back costs more than the transfer. Returns a handle for
  // allreduceBound(). float32, float64 or bfloat16 (summed in float32).
  int bindSum(const at::Tensor& tensor);
  // Runs the bound sums `handles`, in order, in place. Throws NodeFailed.
  void allreduceBound(const std::vector<int>& handles, const char* what);
  // In place: node 0's values everywhere. Throws NodeFailed.
  void broadcastFromNode0(at::Tensor& t, const char* what);
  // Every node contributes `value`; returns all of them in node order. Throws NodeFailed.
  std::vector<std::string> exchange(const std::string& key, const std::string& value);
  std::vector<std::int64_t> allgather(std::int64_t value, const char* what);

 private:
  // The store and node 0's server after a failed or interrupted start-up.
  void releaseStartUp() noexcept;
  [[noreturn]] void fail(const char* what, const std::exception& e, std::int64_t began);
  // Waits for a c10d operation in slices, so that a timeout or
  // interruptWaits() ends it whatever c10d's threads do.
  template <typename W>
  void await(const W& work);
  // Returns f(); what it throws becomes fail(what, ...). Used in node_group.cpp only.
  template <typename F>
  auto guarded(const char* what, F&& f) -> decltype(f());

  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_{0};
  bool abandoned_ = false;  // an operation of c10d's group was given up in flight
};

}  // namespace gradagg::detail
