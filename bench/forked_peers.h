// Forked peer processes for the bench's gloo configurations: a shared anonymous
// mapping to bring results back to the parent, and a set of children that each
// run one function and exit.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <vector>

namespace gradagg::bench {

// An anonymous MAP_SHARED mapping, zero-filled: created before fork, the
// children write into it and the parent reads it after they exit. Move-only.
class SharedMapping {
 public:
  SharedMapping() = default;
  explicit SharedMapping(std::size_t bytes);
  ~SharedMapping();
  SharedMapping(SharedMapping&& other) noexcept;
  SharedMapping& operator=(SharedMapping&& other) noexcept;
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;

  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

// Children forked by spawn(). Each runs `body(rank)` on a FRESH thread (after
// a parent ran OpenMP regions, libgomp in the child's main thread hangs in its
// next parallel region; a new thread gets a new pool) and exits with its
// result through _exit (no parent destructors or atexit handlers run). An
// exception is printed to stderr and exits 1. Children die with the parent
// (PR_SET_PDEATHSIG). The destructor kills and reaps any child still running.
class ForkedPeers {
 public:
  ForkedPeers() = default;
  ~ForkedPeers();
  ForkedPeers(const ForkedPeers&) = delete;
  ForkedPeers& operator=(const ForkedPeers&) = delete;

  void spawn(int n, const std::function<int(int rank)>& body);
  // Waits until every child has exited. Throws std::runtime_error naming the
  // first child that failed (non-zero status or signal; the others are killed)
  // or that was still running at the deadline.
  void join(std::chrono::milliseconds timeout);

 private:
  void killAll() noexcept;
  std::vector<pid_t> pids_;  // -1 once reaped
};

}  // namespace gradagg::bench
