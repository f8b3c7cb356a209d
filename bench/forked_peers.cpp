#include "forked_peers.h"

#include <stdexcept>
#include <string>

namespace gradagg::bench {

void ForkedPeers::spawn(int n, const std::function<int(int rank)>& body) {
  for (int rank = 0; rank < n; ++rank) processes_.spawn([&body, rank] { return body(rank); });
}

void ForkedPeers::join(std::chrono::milliseconds timeout) {
  processes_.waitAll(timeout);
  for (std::size_t rank = 0; rank < processes_.size(); ++rank) {
    const auto exit = processes_.poll(rank);
    if (exit && exit->exit_status == 0) continue;
    processes_.killAll();
    processes_.clear();
    throw std::runtime_error(
        "gradagg-bench: peer " + std::to_string(rank) +
        (exit ? " " + exit->describe()
              : " still running after " + std::to_string(timeout.count()) + " ms; killed"));
  }
  processes_.clear();
}

}  // namespace gradagg::bench
