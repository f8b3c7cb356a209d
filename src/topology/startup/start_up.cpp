#include "topology/startup/start_up.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <future>
#include <mutex>
#include <thread>

#include <c10/util/Logging.h>
#include <fmt/format.h>
#include <gloo/rendezvous/store.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <gradagg/errors.h>

#include "runtime/host_hooks.h"
#include "runtime/interrupt.h"
#include "topology/startup/admission.h"
#include "topology/startup/store_client.h"

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

std::string firstLine(const std::string& text) { return text.substr(0, text.find('\n')); }

// The store: a FileStore at o.store_path, a client of the store that node 0
// serves (StoreServer, StoreClient), or one of the c10d TCPStore that a
// launcher's agent serves (external_store).
c10::intrusive_ptr<c10d::Store> openStore(const NodeOptions& o, const Deadline& deadline) {
  if (!o.store_path.empty()) {
    auto store = c10::make_intrusive<c10d::FileStore>(o.store_path, o.nodes);
    store->setTimeout(deadline.left());
    // c10d creates the file at the first write; a read before it (the
    // admission's first look) would wait for the file for the whole timeout.
    store->add(o.store_prefix + "/opened", 1);
    return store;
  }
  if (!o.external_store)
    return c10::make_intrusive<StoreClient>(o.master_addr, o.master_port, deadline);
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
    } catch (const std::exception& e) {
      if (interruptDue()) {
        FLAGS_caffe2_log_level = level;
        throw;
      }
      if (deadline.left() < std::chrono::milliseconds(50)) {
        FLAGS_caffe2_log_level = level;
        // c10d says "timed out after 0s" of the last short attempt.
        throw std::runtime_error(fmt::format(
            "no store answered at {}:{} (node 0 not started, or not at MASTER_ADDR:MASTER_PORT; "
            "a firewall?); the last attempt: {}",
            o.master_addr, o.master_port, firstLine(e.what())));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

// c10d's ProcessGroupGloo, whose collectives (allgather, allreduce, broadcast)
// wait as long as its gloo contexts' timeout, which the constructor sets from
// the one it connects with: connected within what is left of the start-up,
// then given the whole NodeOptions::timeout for every collective after, so a
// node that waited long for a late peer does not fail a collective early.
class GlooGroup final : public c10d::ProcessGroupGloo {
 public:
  using ProcessGroupGloo::ProcessGroupGloo;
  void setCollectiveTimeout(std::chrono::milliseconds timeout) {
    for (auto& context : contexts_) context->setTimeout(timeout);
  }
};

// c10d's group (the start-up exchanges, the checksums) and the step's own gloo
// context, both over `store`, each connected within what is left of the
// deadline and then waiting up to o.timeout in each collective.
Groups connectGroups(const NodeOptions& o, const c10::intrusive_ptr<c10d::Store>& store,
                     const Deadline& deadline) {
  Groups g;
  const Sockets before = Sockets::now();
  auto options = c10d::ProcessGroupGloo::Options::create(deadline.left());
  options->devices.push_back(o.interface.empty()
                                 ? c10d::ProcessGroupGloo::createDefaultDevice()
                                 : c10d::ProcessGroupGloo::createDeviceForInterface(o.interface));
  options->threads = 2;
  auto group = c10::make_intrusive<GlooGroup>(store, o.node_rank, o.nodes, options);
  group->setCollectiveTimeout(o.timeout);
  g.group = group;
  GlooStore step_store(c10::make_intrusive<c10d::PrefixStore>("step", store));
  g.context = std::make_shared<::gloo::rendezvous::Context>(o.node_rank, o.nodes);
  g.context->setTimeout(deadline.left());
  g.context->connectFullMesh(step_store, options->devices.front());
  g.context->setTimeout(o.timeout);
  g.sockets = Sockets::since(before, Sockets::now());
  return g;
}
}  // namespace

bool isLoopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

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

Started startWithin(const NodeOptions& o, const Deadline& deadline,
                    const std::function<void()>& waiting, c10::intrusive_ptr<RendezvousStore>& base,
                    bool& abandoned) {
  // What the start-up's thread and the caller share: the store once open, and
  // whether the caller gave up (the thread then closes a store it opens later).
  struct Shared {
    std::mutex mutex;
    c10::intrusive_ptr<RendezvousStore> base;
    bool given_up = false;
  };
  auto shared = std::make_shared<Shared>();
  auto task = std::make_shared<std::packaged_task<Started()>>([=] {
    Started s;
    s.base = c10::make_intrusive<RendezvousStore>(openStore(o, deadline), deadline);
    {
      std::lock_guard<std::mutex> lock(shared->mutex);
      shared->base = s.base;
      if (shared->given_up) s.base->close();  // the admission's first call ends it
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
      checkHostInterrupt();
      throwIfStopped(deadline, "the other nodes");
      waiting();  // also while node 0's store does not answer yet
    }
  } catch (...) {
    // Anything: a stop, the deadline, or the host's interrupt (Python's
    // KeyboardInterrupt, no std::exception). The store closed, the thread's next
    // store call throws (its waits poll): joined when it ends within kLetGo, so
    // nothing of it outlives this call; else left to finish alone.
    {
      std::lock_guard<std::mutex> lock(shared->mutex);
      shared->given_up = true;
      base = shared->base;
    }
    if (base) base->close();
    constexpr auto kLetGo = std::chrono::milliseconds(500);
    if (done.wait_for(kLetGo) == std::future_status::ready) {
      thread.join();
    } else {
      thread.detach();
      abandoned = true;
    }
    throw;
  }
  thread.join();  // gone before any fork
  return done.get();
}

}  // namespace gradagg::detail
