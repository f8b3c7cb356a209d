// The start-up of a group of node parents, before NodeGroup takes it over:
// the store, the admission (topology/startup/admission.h), c10d's group and the
// step's own gloo mesh, made in a thread of its own within the deadline.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <gloo/rendezvous/context.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <gradagg/options.h>

#include "topology/startup/rendezvous_store.h"
#include "topology/startup/sockets.h"

namespace gradagg::detail {

bool isLoopback(const std::string& addr);

// A MASTER_ADDR that does not resolve is bad input (InvalidArgument), not a timeout.
void requireResolvable(const NodeOptions& o);

struct Groups {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  std::shared_ptr<::gloo::rendezvous::Context> context;
  Sockets sockets;  // both's connections to the other nodes
};

// What the start-up makes, in the order it makes them.
struct Started {
  c10::intrusive_ptr<RendezvousStore> base;  // node 0's store, a launcher's or a FileStore
  c10::intrusive_ptr<c10d::Store> store;     // base, under this run's private prefix
  Groups groups;
};

// The start-up in a thread of its own, waited for in slices by the caller: a
// store stalled by a stray client, gloo's connects to a dead address and
// c10d's own retries overshoot their timeouts, and no signal reaches them. At
// the deadline, on interruptWaits() or on the host's interrupt (anything
// thrown) it closes the store, so that the thread's next store operation ends
// it, and rethrows once the thread ended (joined), or after 500 ms with the
// thread left to finish alone and `abandoned` set: it may still be in a call of
// c10d's or gloo's. `base` is then what there is of the store (closed). `waiting` runs
// between the admission's polls and the caller's (the waiting line).
Started startWithin(const NodeOptions& o, const Deadline& deadline,
                    const std::function<void()>& waiting, c10::intrusive_ptr<RendezvousStore>& base,
                    bool& abandoned);

}  // namespace gradagg::detail
