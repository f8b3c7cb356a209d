// Admission: which processes in the store are this run's nodes, before
// anything else crosses. The store may be shared with strangers (a TCPStore
// anyone reaching the port can use) or hold a dead run's keys (a FileStore
// left by a crash), so node 0 makes a fresh run id and admits every other
// node by a nonce it chose itself, each side proving the job token:
//
//   node r (r > 0)                         node 0
//   join/r    = n_r                 ──►    reads join/r (again whenever it
//                                          changes: the first may be stale)
//             ◄──  ack/r = "R n_r " HMAC(token, "ack R r n_r")
//   waits for an ack naming n_r (older acks are a dead run's), checks it
//   confirm/r = "R n_r " HMAC(token, "confirm R r n_r")  ──►  checks it
//                                          once every node is confirmed:
//             ◄──  <private>/ready
//
// where <private> = R without a token, HMAC(token, "keys R") with one: a
// process without the token cannot name the keys that follow (the store
// lists none), and a dead run's keys are under another R. A proof that does
// not match means another token: refused at once, on both sides.
#pragma once

#include <functional>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <gradagg/options.h>

#include "topology/startup/rendezvous_store.h"

namespace gradagg::detail {

// Runs this node's side within `deadline`; returns the private prefix (under
// o.store_prefix) for every later key. Throws InvalidArgument when a peer
// proves another token, std::runtime_error when the deadline passes or the
// wait is interrupted. `between` runs between polls (the host's interrupt
// check, the waiting line).
std::string admit(c10d::Store& store, const NodeOptions& o, const Deadline& deadline,
                  const std::function<void()>& between);

}  // namespace gradagg::detail
