// Forked peer processes for the bench's gloo configurations: children that each
// run one function and exit, on the library's process owner (src/runtime/process.h:
// fresh thread, PR_SET_PDEATHSIG, killed and reaped by the destructor). Results
// come back through a shared anonymous mapping, the library's Segment.
#pragma once

#include <chrono>
#include <functional>

#include "runtime/process.h"
#include "runtime/segment.h"

namespace gradagg::bench {

class ForkedPeers {
 public:
  // Forks n children; child `rank` runs body(rank) and exits with its result.
  void spawn(int n, const std::function<int(int rank)>& body);
  // Waits until every child has exited. Throws std::runtime_error naming the
  // first child that failed (non-zero status or signal; the others are killed)
  // or that was still running at the deadline.
  void join(std::chrono::milliseconds timeout);

 private:
  detail::ProcessSet processes_;
};

// Zero-filled shared memory, mapped before fork: the children write into it and
// the parent reads it after they exit.
inline void* sharedMapping(detail::Segment& owner, std::size_t bytes) {
  const std::size_t page = detail::pageBytes();
  owner = detail::Segment::createAnonymous((bytes + page - 1) / page * page);
  return owner.base();
}

}  // namespace gradagg::bench
