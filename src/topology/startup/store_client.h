// StoreClient: a node's connection to node 0's StoreServer (store_wire.h), a
// c10d::Store that RendezvousStore forwards to. Synchronous, one socket, no
// thread of its own: every call sends and waits in the calling thread, in
// polls of 20 ms, until the start-up's deadline (or 1 s after the call began,
// whichever is later) or interruptWaits(). A server that goes away (node 0
// died, its store was stopped) is a std::runtime_error from the call that
// finds it, and from every call after; c10d 1.13's TCPStore client instead
// aborted the process from its background thread (std::terminate).
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "topology/startup/rendezvous_store.h"

namespace gradagg::detail {

class StoreClient final : public c10d::Store {
 public:
  // Connects to addr:port, retrying while nothing answers, and greets the
  // server, all within `deadline`. Throws std::runtime_error ("no store
  // answered at ADDR:PORT ...") at the deadline.
  StoreClient(const std::string& addr, int port, Deadline deadline);
  ~StoreClient() override;
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  // Throws when the key is not there (RendezvousStore waits for it first).
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  // Polls check() until the keys are there.
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  // Sends one request frame and returns its reply's fields (after kOk).
  // Throws std::runtime_error naming `what`; a failure of the connection
  // closes it for good.
  std::string call(const std::string& request, const char* what);
  void fail(const std::string& what, const std::string& why);

  std::mutex mutex_;   // one call at a time on the socket
  int fd_ = -1;        // -1: never connected, or lost
  std::string where_;  // "ADDR:PORT"
  std::string lost_;   // why the connection was lost
  Deadline deadline_;
};

}  // namespace gradagg::detail
