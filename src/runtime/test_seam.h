// Test seam: fault-injection hooks for gradagg's own tests, not for users.
//
// The hooks are process-global and set in the parent before it forks; every
// worker inherits them through fork and calls them in its own process. Code
// under test calls them only through the helpers below, which cost one load of
// an empty std::function when no test set them.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>

#include <gradagg/errors.h>

namespace gradagg::detail {

struct TestHooks {
  // In an aggregator worker (or population member) as it enters each phase.
  std::function<void(int rank, Phase phase, std::int64_t step)> on_worker_phase;
  // In a population member, halfway through writing its snapshot `version`.
  std::function<void(int rank, std::uint64_t version)> on_publish_midway;
};

// The process's hooks (empty unless a test set them).
TestHooks& testHooks();

// Clears the hooks for a scope (a test), which sets them through ->, and
// restores the previous ones after.
class ScopedTestHooks {
 public:
  ScopedTestHooks() : saved_(std::exchange(testHooks(), TestHooks{})) {}
  ~ScopedTestHooks() { testHooks() = std::move(saved_); }
  ScopedTestHooks(const ScopedTestHooks&) = delete;
  ScopedTestHooks& operator=(const ScopedTestHooks&) = delete;
  TestHooks* operator->() const { return &testHooks(); }

 private:
  TestHooks saved_;
};

}  // namespace gradagg::detail
