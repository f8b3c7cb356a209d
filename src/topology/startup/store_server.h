// StoreServer: node 0's store for the start-up, gradagg's own (store_wire.h),
// served by a child process of its own. Not c10d's TCPStore server: its 1.13
// server reads each client's message to the end before it serves anyone else,
// so one connection that sends a byte and holds it stalls every node's start-up
// (docs/multinode.md, Security). This one polls non-blocking sockets, each
// with its own buffer: a connection that sends part of a frame, garbage, a
// length over wire::kMaxFrame, or nothing at all costs only itself (it is
// closed: garbage at once, a stall after kStallLimit). Served from a child, the
// listening window closes when the start-up ends (stop()), a stray's bytes
// are held by the child and not node 0, and the child dies with node 0.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>

#include "topology/startup/rendezvous_store.h"

namespace gradagg::detail {

class StoreServer {
 public:
  // A connection that holds part of a frame (or a reply it does not read) this
  // long, or has not greeted (wire::kHello) this long after it connected, is closed.
  static constexpr std::chrono::milliseconds kStallLimit{2000};
  // At most this many connections at once; more are closed as they come.
  static constexpr int kMaxConnections = 256;
  // The keys and values together: a set beyond it is refused.
  static constexpr std::size_t kMaxStoreBytes = std::size_t{512} << 20;

  // Forks the server and waits (within `deadline`) until it listens on port
  // `port` of every interface (IPv6 and IPv4, as c10d's did). Throws
  // std::runtime_error with the reason (a port in use).
  StoreServer(int port, const Deadline& deadline);
  ~StoreServer() { stop(); }
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // Kills and reaps the server; idempotent. Only the process that forked it
  // does (a copy made by fork() forgets it). Its clients then get an error
  // from their next call (store_client.h), never a signal.
  void stop() noexcept;

 private:
  pid_t pid_ = -1;
  pid_t owner_ = -1;
};

}  // namespace gradagg::detail
