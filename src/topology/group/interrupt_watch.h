// InterruptWatch: ends the cross-node collectives on interruptWaits(). They
// run inside gloo (the step's in the caller's thread, c10d's in its own),
// where no signal reaches; each collective is a Wait here (NodeGroup::guarded),
// and a thread of ours looks every 10 ms whether the request is due for the
// oldest wait in progress (its patience passed since the request and the
// wait's start). Then it shuts down the group's sockets: gloo's waiters here
// wake with an error at once, and so do the peers' (they see the connection end).
//
// gloo keeps its sockets private: the group's are the sockets this process
// opened while it connected (Sockets::since), told apart from a later socket
// on the same descriptor by their inode.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "topology/startup/sockets.h"

namespace gradagg::detail {

class InterruptWatch {
 public:
  explicit InterruptWatch(Sockets group);
  ~InterruptWatch();
  InterruptWatch(const InterruptWatch&) = delete;
  InterruptWatch& operator=(const InterruptWatch&) = delete;

  // A collective in progress, from construction to destruction.
  class Wait {
   public:
    explicit Wait(InterruptWatch& watch);
    ~Wait();
    Wait(const Wait&) = delete;
    Wait& operator=(const Wait&) = delete;
    std::int64_t began() const { return began_; }

   private:
    InterruptWatch& watch_;
    std::int64_t began_;
  };

  // Shuts the group's sockets down now (idempotent), whatever the request
  // says; `interrupted`: because of interruptWaits().
  void shutDown(bool interrupted = false) noexcept;
  // The sockets were shut down because of interruptWaits().
  bool interrupted() const;

 private:
  Sockets group_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool done_ = false;
  bool interrupted_ = false;
  std::vector<std::int64_t> waits_;  // the start of each wait in progress
  std::thread thread_;
};

}  // namespace gradagg::detail
