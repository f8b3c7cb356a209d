// The store as the start-up sees it. Node 0's store (StoreClient), a
// launcher's c10d TCPStore or a c10d FileStore sits behind
// a c10d::Store of our own whose waits poll, so that every wait of the start-up
// (ours, c10d's group and gloo's mesh asking for peer addresses) ends at the
// start-up's deadline or at interruptWaits(), whatever c10d's own timeouts do;
// and which lets the real store go once the start-up is over: a store client
// disconnects (node 0 then stops serving), a FileStore's file is removed
// by the last node that lets it go. Used after close() it throws.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace gradagg::detail {

using SteadyClock = std::chrono::steady_clock;

struct Deadline {
  SteadyClock::time_point at;
  // What is left (at least 1 ms).
  std::chrono::milliseconds left() const;
  bool passed() const { return SteadyClock::now() >= at; }
};

// Polls `ready` (1 ms, doubling to 20 ms) until it returns true. Throws
// std::runtime_error naming `what` at `deadline`, or when interruptWaits() was
// due for a wait that began at `began` (throwIfStopped; 0: the rendezvous).
template <typename Ready>
void pollUntil(const Deadline& deadline, const std::string& what, Ready&& ready);
void throwIfStopped(const Deadline& deadline, const std::string& what, std::int64_t began = 0);

class RendezvousStore final : public c10d::Store {
 public:
  RendezvousStore(c10::intrusive_ptr<c10d::Store> base, Deadline deadline);

  // Lets the real store go; every later call throws.
  void close();

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  c10::intrusive_ptr<c10d::Store> base() const;

  mutable std::mutex mutex_;
  c10::intrusive_ptr<c10d::Store> base_;  // null once closed
  Deadline deadline_;
};

template <typename Ready>
void pollUntil(const Deadline& deadline, const std::string& what, Ready&& ready) {
  auto pause = std::chrono::milliseconds(1);
  while (!ready()) {
    throwIfStopped(deadline, what);
    std::this_thread::sleep_for(std::min(pause, deadline.left()));
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

}  // namespace gradagg::detail
