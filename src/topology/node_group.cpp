#include "topology/node_group.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <future>
#include <thread>

#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <gradagg/errors.h>

#include "runtime/host_hooks.h"
#include "runtime/interrupt.h"
#include "topology/admission.h"
#include "topology/interrupt_watch.h"
#include "topology/rendezvous_store.h"
#include "topology/store_server.h"

namespace gradagg::detail {

namespace {
// gloo's rendezvous over a c10d store.
class GlooStore final : public ::gloo::rendezvous::Store {
 public:
  explicit GlooStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::vector<std::uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const auto bytes = store_->get(key);
    return std::vector<char>(bytes.begin(), bytes.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};
}  // namespace

struct NodeGroup::Impl {
  std::unique_ptr<StoreServer> server;           // node 0's TCPStore, for the start-up
  c10::intrusive_ptr<RendezvousStore> base;      // the TCPStore or FileStore
  c10::intrusive_ptr<c10d::Store> store;         // base, under this run's private prefix
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

// The host's interrupt check (Python: the pending signal handlers), if any.
void checkHost() {
  if (const auto& check = hostHooks().check_interrupt) check();
}

void armHost() {
  if (const auto& arm = hostHooks().arm_interrupt) arm();
}

bool isLoopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

// A MASTER_ADDR that does not resolve is bad input, not a timeout.
void requireResolvable(const NodeOptions& o) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int r = ::getaddrinfo(o.master_addr.c_str(), nullptr, &hints, &found);
  if (found != nullptr) ::freeaddrinfo(found);
  if (r != 0)
    throw InvalidArgument(fmt::format(
        "gradagg: node {} of {}: NodeOptions::master_addr (MASTER_ADDR) '{}' does not resolve: {}",
        o.node_rank, o.nodes, o.master_addr, ::gai_strerror(r)));
}

// The store: a FileStore at o.store_path, or a client of the TCPStore that
// node 0 serves (StoreServer) or a launcher does.
c10::intrusive_ptr<c10d::Store> openStore(const NodeOptions& o, const Deadline& deadline) {
  if (!o.store_path.empty()) {
    auto store = c10::make_intrusive<c10d::FileStore>(o.store_path, o.nodes);
    store->setTimeout(deadline.left());
    // c10d creates the file at the first write; a read before it (the
    // admission's first look) would wait for the file for the whole timeout.
    store->add(o.store_prefix + "/opened", 1);
    return store;
  }
  c10d::TCPStoreOptions t;
  t.port = static_cast<std::uint16_t>(o.master_port);
  t.isServer = false;
  t.numWorkers = o.nodes;
  t.waitWorkers = false;
  // c10d retries the connection itself, a line in its log each time: ask
  // for short attempts, quietly, and retry here within the deadline.
  const int level = FLAGS_caffe2_log_level;
  FLAGS_caffe2_log_level = 3;  // fatal only: each refused attempt is an "error" there
  for (;;) {
    t.timeout = std::min(deadline.left(), std::chrono::milliseconds(1000));
    try {
      auto store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, t);
      FLAGS_caffe2_log_level = level;
      store->setTimeout(deadline.left());
      return store;
    } catch (const std::exception&) {
      if (interruptRequested() || deadline.left() < std::chrono::milliseconds(50)) {
        FLAGS_caffe2_log_level = level;
        throw;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

struct Groups {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  std::shared_ptr<::gloo::rendezvous::Context> context;
  Sockets sockets;  // both's connections to the other nodes
};

// c10d's group (the start-up exchanges, the checksums) and the step's own gloo
// context, both over `store`, each with what is left of the deadline.
Groups connectGroups(const NodeOptions& o, const c10::intrusive_ptr<c10d::Store>& store,
                     const Deadline& deadline) {
  Groups g;
  const Sockets before = Sockets::now();
  auto options = c10d::ProcessGroupGloo::Options::create(deadline.left());
  options->devices.push_back(o.interface.empty()
                                 ? c10d::ProcessGroupGloo::createDefaultDevice()
                                 : c10d::ProcessGroupGloo::createDeviceForInterface(o.interface));
  options->threads = 2;
  g.group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, o.node_rank, o.nodes, options);
  GlooStore step_store(c10::make_intrusive<c10d::PrefixStore>("step", store));
  g.context = std::make_shared<::gloo::rendezvous::Context>(o.node_rank, o.nodes);
  g.context->setTimeout(deadline.left());
  g.context->connectFullMesh(step_store, options->devices.front());
  g.context->setTimeout(o.timeout);
  g.sockets = Sockets::since(before, Sockets::now());
  return g;
}

// What the start-up makes, in the order it makes them.
struct Started {
  c10::intrusive_ptr<RendezvousStore> base;
  c10::intrusive_ptr<c10d::Store> store;
  Groups groups;
};

// The start-up (the store, the admission, c10d's group, the step's gloo mesh)
// in a thread of its own, waited for in slices by the caller: a store stalled
// by a stray client, gloo's connects to a dead address and c10d's own retries
// overshoot their timeouts, and no signal reaches them. At the deadline or on
// interruptWaits() the thread is left to finish alone (its store closed, so
// its next store operation ends it); `base` is set as soon as there is one.
Started startWithin(const NodeOptions& o, const Deadline& deadline,
                    const std::function<void()>& waiting,
                    c10::intrusive_ptr<RendezvousStore>& base) {
  auto shared_base = std::make_shared<c10::intrusive_ptr<RendezvousStore>>();
  auto base_mutex = std::make_shared<std::mutex>();
  auto task = std::make_shared<std::packaged_task<Started()>>([=] {
    Started s;
    s.base = c10::make_intrusive<RendezvousStore>(openStore(o, deadline), deadline);
    {
      std::lock_guard<std::mutex> lock(*base_mutex);
      *shared_base = s.base;
    }
    const std::string prefix = admit(*s.base, o, deadline, waiting);
    s.store = c10::make_intrusive<c10d::PrefixStore>(o.store_prefix + "/" + prefix, s.base);
    s.groups = connectGroups(o, s.store, deadline);
    return s;
  });
  std::future<Started> done = task->get_future();
  std::thread thread([task] { (*task)(); });
  try {
    while (done.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) {
      checkHost();
      throwIfStopped(deadline, "the other nodes");
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(*base_mutex);
    base = *shared_base;
    thread.detach();
    throw;
  }
  thread.join();  // gone before any fork
  return done.get();
}
}  // namespace

NodeGroup::NodeGroup(const NodeOptions& o)
    : impl_(std::make_unique<Impl>()), rank_(o.node_rank), size_(o.nodes), timeout_(o.timeout) {
  clearInterrupt();
  armHost();
  const bool tcp = o.store_path.empty();
  if (tcp) requireResolvable(o);
  // The rendezvous as a whole honours o.timeout: each of its stages (the
  // store, the admission, c10d's group, the step's gloo mesh) gets what is
  // left of it.
  const Deadline deadline{SteadyClock::now() + o.timeout};
  const auto began = SteadyClock::now();
  const std::function<void()> waiting = [began, rank = o.node_rank, nodes = o.nodes,
                                         ms = static_cast<long long>(o.timeout.count()),
                                         said = false]() mutable {
    if (said || SteadyClock::now() - began < std::chrono::seconds(1)) return;
    said = true;
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
      impl_->server = std::make_unique<StoreServer>(o.master_addr, o.master_port, o.nodes, deadline);
    }
    Started started = startWithin(o, deadline, waiting, impl_->base);
    impl_->base = std::move(started.base);
    impl_->store = std::move(started.store);
    impl_->group = std::move(started.groups.group);
    impl_->context = std::move(started.groups.context);
    impl_->watch = std::make_unique<InterruptWatch>(std::move(started.groups.sockets));
  } catch (const InvalidArgument&) {
    throw;
  } catch (const std::exception& e) {
    if (impl_->base) impl_->base->close();  // an abandoned start-up's next wait ends at once
    const std::string where = tcp ? fmt::format("TCPStore {}:{}", o.master_addr, o.master_port)
                                  : "FileStore " + o.store_path;
    if (interruptRequested())
      throw Interrupted(fmt::format("gradagg: node {} of {}: interrupted at the rendezvous "
                                    "through {} (interruptWaits(): a stop signal)",
                                    o.node_rank, o.nodes, where),
                        o.node_rank);
    throw NodeFailed(fmt::format("gradagg: node {} of {}: rendezvous through {} failed within {} "
                                 "ms: {}",
                                 o.node_rank, o.nodes, where, o.timeout.count(), message(e)),
                     o.node_rank);
  }
}

void NodeGroup::endRendezvous() {
  // Every node lets its store client go before node 0 stops serving: c10d's
  // client does not outlive its server gracefully (store_server.h).
  impl_->base->close();
  allgather(0, "the end of the start-up");
  if (impl_->server) impl_->server->stop();
}

NodeGroup::~NodeGroup() {
  impl_->watch.reset();
  // c10d's group joins its threads when destroyed; one of them may still
  // wait in gloo for an operation given up on: leave it to the process's exit.
  if (abandoned_ && impl_->group) (void)impl_->group.release();
}

void NodeGroup::fail(const char* what, const std::exception& e) {
  if (interruptRequested()) {
    if (impl_->watch) impl_->watch->shutDown();
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
  try {
    return f();
  } catch (const std::exception& e) {
    fail(what, e);
  }
}

template <typename W>
void NodeGroup::await(const W& work) {
  const Deadline until{SteadyClock::now() + timeout_};
  for (;;) {
    try {
      work->wait(std::chrono::milliseconds(20));
      return;
    } catch (...) {
      if (work->isCompleted()) throw;  // its own failure, not the slice's end
    }
    try {
      checkHost();
      throwIfStopped(until, "a peer node");
    } catch (...) {
      abandoned_ = true;
      impl_->watch->shutDown();  // the peers fail at once, not at their timeout
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
  armHost();
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
