#include "topology/group/node_group.h"

#include <atomic>
#include <cstdio>
#include <optional>

#include <gloo/allreduce.h>
#include <gloo/math.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <gradagg/errors.h>

#include "runtime/host_hooks.h"
#include "runtime/interrupt.h"
#include "runtime/signal_blocked.h"
#include "topology/group/interrupt_watch.h"
#include "topology/startup/rendezvous_store.h"
#include "topology/startup/start_up.h"
#include "topology/startup/store_server.h"

namespace gradagg::detail {

struct NodeGroup::Impl {
  std::unique_ptr<StoreServer> server;       // node 0's store, for the start-up
  c10::intrusive_ptr<RendezvousStore> base;  // node 0's store, a launcher's or a FileStore
  c10::intrusive_ptr<c10d::Store> store;     // base, under this run's private prefix
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  // The step's collectives: a gloo context of its own and one bound sum each.
  std::shared_ptr<::gloo::rendezvous::Context> context;
  std::vector<std::unique_ptr<::gloo::AllreduceOptions>> sums;
  std::unique_ptr<InterruptWatch> watch;
};

namespace {
std::string message(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}
}  // namespace

NodeGroup::NodeGroup(const NodeOptions& o)
    : impl_(std::make_unique<Impl>()), rank_(o.node_rank), size_(o.nodes), timeout_(o.timeout) {
  // Gloo writes with writev: a write to a peer that has gone (or to a socket
  // shut down at a timeout) raises SIGPIPE in the writing thread, and a C++
  // program's default action is to die without a word. Every thread c10d and
  // gloo start here (the store's, the group's workers, gloo's event loops)
  // inherits SIGPIPE blocked, so such a write is EPIPE and NodeFailed;
  // guarded() does the same for the calling thread's own collectives.
  const SignalBlocked no_sigpipe(SIGPIPE);
  armHostInterrupt();
  const bool tcp = o.store_path.empty();
  if (tcp) requireResolvable(o);
  bool abandoned = false;  // the start-up's thread was left in a call
  // The rendezvous as a whole honours o.timeout: each of its stages (the
  // store, the admission, c10d's group, the step's gloo mesh) gets what is
  // left of it.
  const Deadline deadline{SteadyClock::now() + o.timeout};
  const auto began = SteadyClock::now();
  // Called from the start-up's thread and the caller's: one line in all.
  const std::function<void()> waiting = [began, rank = o.node_rank, nodes = o.nodes,
                                         ms = static_cast<long long>(o.timeout.count()),
                                         said = std::make_shared<std::atomic<bool>>(false)] {
    if (SteadyClock::now() - began < std::chrono::seconds(1) || said->exchange(true)) return;
    std::fprintf(stderr, "gradagg: node %d of %d: waiting for the other nodes (up to %lld ms)\n",
                 rank, nodes, ms);
  };
  try {
    if (tcp && o.node_rank == 0 && !o.external_store) {
      if (o.token.empty() && !isLoopback(o.master_addr))
        std::fprintf(stderr,
                     "gradagg: warning: node 0 serves the rendezvous on port %d without a job "
                     "token: anyone who reaches it can join (docs/multinode.md, Security)\n",
                     o.master_port);
      impl_->server = std::make_unique<StoreServer>(o.master_port, deadline);
    }
    Started started = startWithin(o, deadline, waiting, impl_->base, abandoned);
    impl_->base = std::move(started.base);
    impl_->store = std::move(started.store);
    impl_->group = std::move(started.groups.group);
    impl_->context = std::move(started.groups.context);
    impl_->watch = std::make_unique<InterruptWatch>(std::move(started.groups.sockets));
  } catch (const InvalidArgument&) {
    releaseStartUp();
    throw;
  } catch (const std::exception& e) {
    releaseStartUp();
    const std::string where =
        !tcp ? "FileStore " + o.store_path
             : fmt::format("{} {}:{}",
                           o.external_store ? "the launcher's TCPStore" : "node 0's store",
                           o.master_addr, o.master_port);
    if (interruptDue())
      throw Interrupted(fmt::format("gradagg: node {} of {}: interrupted at the rendezvous "
                                    "through {} (interruptWaits(): a stop signal)",
                                    o.node_rank, o.nodes, where),
                        o.node_rank);
    throw NodeFailed(fmt::format("gradagg: node {} of {}: rendezvous through {} failed within {} "
                                 "ms: {}",
                                 o.node_rank, o.nodes, where, o.timeout.count(), message(e)),
                     o.node_rank);
  } catch (...) {
    // The host's interrupt (Python's KeyboardInterrupt, or what its signal
    // handler raised): no std::exception, the same release, then as it is.
    releaseStartUp();
    throw;
  }
}

// What a failed start-up leaves: the store closed (an abandoned start-up's next
// wait ends at once) and node 0's server stopped. An abandoned start-up's
// client of it (store_client.h) ends its call with an error when the server
// goes: nothing of it runs in a thread of its own that could abort.
void NodeGroup::releaseStartUp() noexcept {
  if (impl_->base) impl_->base->close();
  if (impl_->server) impl_->server->stop();
}

void NodeGroup::endRendezvous() {
  // Every node lets its store client go before node 0 stops serving (a
  // launcher's c10d client does not outlive its server gracefully).
  const SignalBlocked no_sigpipe(SIGPIPE);  // the client's last words to a store gone
  impl_->base->close();
  allgather(0, "the end of the start-up");
  if (impl_->server) impl_->server->stop();
}

NodeGroup::~NodeGroup() {
  const SignalBlocked no_sigpipe(SIGPIPE);  // gloo's pairs close in this thread
  impl_->watch.reset();
  // c10d's group joins its threads when destroyed; one of them may still
  // wait in gloo for an operation given up on: leave it to the process's exit.
  if (abandoned_ && impl_->group) (void)impl_->group.release();
}

void NodeGroup::fail(const char* what, const std::exception& e, std::int64_t began) {
  if ((impl_->watch && impl_->watch->interrupted()) || interruptDue(began)) {
    if (impl_->watch) impl_->watch->shutDown(true);
    throw Interrupted(fmt::format("gradagg: node {} of {}: interrupted during {} "
                                  "(interruptWaits(): a stop signal)",
                                  rank_, size_, what),
                      rank_);
  }
  throw NodeFailed(fmt::format("gradagg: node {} of {}: {} failed (a peer node died, stalled "
                               "past {} ms, or disagrees): {}",
                               rank_, size_, what, timeout_.count(), message(e)),
                   rank_);
}

template <typename F>
auto NodeGroup::guarded(const char* what, F&& f) -> decltype(f()) {
  std::optional<InterruptWatch::Wait> wait;  // what interruptWaits()' patience counts from
  if (impl_->watch) wait.emplace(*impl_->watch);
  const std::int64_t began = wait ? wait->began() : monotonicNowNs();
  const SignalBlocked no_sigpipe(
      SIGPIPE);  // gloo's writes in this thread (the constructor's comment)
  try {
    return f();
  } catch (const std::exception& e) {
    fail(what, e, began);
  }
}

template <typename W>
void NodeGroup::await(const W& work) {
  const Deadline until{SteadyClock::now() + timeout_};
  const std::int64_t began = monotonicNowNs();
  for (;;) {
    try {
      work->wait(std::chrono::milliseconds(20));
      return;
    } catch (...) {
      // c10d 1.13 throws "Operation timed out!" at a slice's end; work that
      // completed since then is waited for again: its own result, or its failure.
      if (work->isCompleted()) {
        work->wait();
        return;
      }
    }
    try {
      checkHostInterrupt();
      throwIfStopped(until, "a peer node", began);
    } catch (...) {
      abandoned_ = true;
      impl_->watch->shutDown(interruptDue(began));  // the peers fail at once, not at their timeout
      throw;
    }
  }
}

void NodeGroup::allreduceSum(at::Tensor& t, const char* what) {
  guarded(what, [&] {
    std::vector<at::Tensor> tensors{t};
    await(impl_->group->allreduce(tensors));
  });
}

namespace {
// bf16 + bf16 in float32, rounded to bf16 (nearest even) once.
void sumBFloat16(void* out, const void* a, const void* b, std::size_t n) {
  auto* c = static_cast<c10::BFloat16*>(out);
  const auto* x = static_cast<const c10::BFloat16*>(a);
  const auto* y = static_cast<const c10::BFloat16*>(b);
  for (std::size_t i = 0; i < n; ++i)
    c[i] = c10::BFloat16(static_cast<float>(x[i]) + static_cast<float>(y[i]));
}
}  // namespace

int NodeGroup::bindSum(const at::Tensor& tensor) {
  auto sum = std::make_unique<::gloo::AllreduceOptions>(impl_->context);
  const auto count = static_cast<std::size_t>(tensor.numel());
  if (tensor.scalar_type() == at::kBFloat16) {
    sum->setOutput(reinterpret_cast<std::uint16_t*>(tensor.data_ptr()), count);
    sum->setReduceFunction(&sumBFloat16);
  } else if (tensor.scalar_type() == at::kDouble) {
    sum->setOutput(tensor.data_ptr<double>(), count);
    sum->setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, std::size_t)>(&::gloo::sum<double>));
  } else {
    sum->setOutput(tensor.data_ptr<float>(), count);
    sum->setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, std::size_t)>(&::gloo::sum<float>));
  }
  const int handle = static_cast<int>(impl_->sums.size());
  sum->setTag(static_cast<std::uint32_t>(handle));
  sum->setTimeout(timeout_);
  impl_->sums.push_back(std::move(sum));
  return handle;
}

void NodeGroup::allreduceBound(const std::vector<int>& handles, const char* what) {
  armHostInterrupt();
  guarded(what, [&] {
    for (const int h : handles) ::gloo::allreduce(*impl_->sums[static_cast<std::size_t>(h)]);
  });
}

void NodeGroup::broadcastFromNode0(at::Tensor& t, const char* what) {
  guarded(what, [&] {
    std::vector<at::Tensor> tensors{t};
    await(impl_->group->broadcast(tensors));
  });
}

std::vector<std::int64_t> NodeGroup::allgather(std::int64_t value, const char* what) {
  return guarded(what, [&] {
    std::vector<at::Tensor> input{at::full({1}, value, at::kLong)};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int r = 0; r < size_; ++r) output[0].push_back(at::empty({1}, at::kLong));
    await(impl_->group->allgather(output, input));
    std::vector<std::int64_t> out;
    for (const auto& t : output[0]) out.push_back(t.item<std::int64_t>());
    return out;
  });
}

std::vector<std::string> NodeGroup::exchange(const std::string& key, const std::string& value) {
  const std::string what = "exchanging " + key;
  return guarded(what.c_str(), [&] {
    impl_->store->set(fmt::format("{}/{}", key, rank_),
                      std::vector<std::uint8_t>(value.begin(), value.end()));
    std::vector<std::string> out;
    for (int r = 0; r < size_; ++r) {
      const auto bytes = impl_->store->get(fmt::format("{}/{}", key, r));
      out.emplace_back(bytes.begin(), bytes.end());
    }
    return out;
  });
}

}  // namespace gradagg::detail
