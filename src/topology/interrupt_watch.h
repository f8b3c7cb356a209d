// InterruptWatch: ends the cross-node collectives on interruptWaits(). They
// run inside gloo (the step's in the caller's thread, c10d's in its own),
// where no signal reaches; a thread of ours looks at the flag every 20 ms and,
// once it is set, shuts down the group's sockets: gloo's waiters here wake with
// an error at once, and so do the peers' (they see the connection end).
//
// gloo keeps its sockets private: the group's are the sockets this process
// opened while it connected (Sockets::since), told apart from a later socket
// on the same descriptor by their inode.
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <sys/types.h>

namespace gradagg::detail {

struct Sockets {
  std::vector<std::pair<int, ino_t>> open;  // descriptor, inode
  // This process's sockets now.
  static Sockets now();
  // Those in `later` that are not in `earlier`.
  static Sockets since(const Sockets& earlier, const Sockets& later);
};

class InterruptWatch {
 public:
  explicit InterruptWatch(Sockets group);
  ~InterruptWatch();
  InterruptWatch(const InterruptWatch&) = delete;
  InterruptWatch& operator=(const InterruptWatch&) = delete;

  // Shuts the group's sockets down now (idempotent), whatever the flag says.
  void shutDown() noexcept;

 private:
  Sockets group_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace gradagg::detail
