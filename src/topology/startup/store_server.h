// StoreServer: node 0's TCPStore, served by a child process of its own for
// the start-up only. c10d 1.13's TCPStore listens on every interface, has no
// authentication, and its server thread stalls on a client that sends part of
// a message (and its destructor then waits for it for ever). Served from a
// child, the listening window closes when the start-up ends (stop(): SIGKILL),
// and nothing a stray client holds open can keep node 0 from exiting.
#pragma once

#include <sys/types.h>

#include <string>

#include "topology/startup/rendezvous_store.h"

namespace gradagg::detail {

class StoreServer {
 public:
  // Forks the server and waits (within `deadline`) until it listens on
  // addr:port. Throws std::runtime_error with c10d's reason (a port in use).
  StoreServer(const std::string& addr, int port, int nodes, const Deadline& deadline);
  ~StoreServer() { stop(); }
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // Kills and reaps the server; idempotent. Only the process that forked it
  // does (a copy made by fork() forgets it).
  void stop() noexcept;
  // Forgets the server: it exits when this process does (it watches its
  // parent). For a start-up abandoned with a client of it in a call: c10d
  // 1.13's client thread aborts the process when its server goes first.
  void leaveToTheProcessEnd() noexcept { pid_ = -1; }

 private:
  pid_t pid_ = -1;
  pid_t owner_ = -1;
};

}  // namespace gradagg::detail
