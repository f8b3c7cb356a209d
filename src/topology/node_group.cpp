#include "topology/node_group.h"

#include <algorithm>
#include <thread>

#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <gradagg/errors.h>

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
  c10::intrusive_ptr<c10d::Store> base;   // the TCPStore or FileStore
  c10::intrusive_ptr<c10d::Store> store;  // base, under the prefix "gradagg"
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  // The step's collectives: a gloo context of its own and one bound sum each.
  std::shared_ptr<::gloo::rendezvous::Context> context;
  std::vector<std::unique_ptr<::gloo::AllreduceOptions>> sums;
};

namespace {
std::string message(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}
}  // namespace

namespace {
using SteadyClock = std::chrono::steady_clock;

// What is left of the rendezvous' deadline (at least 1 ms).
struct Deadline {
  SteadyClock::time_point at;
  std::chrono::milliseconds left() const {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(at - SteadyClock::now()));
  }
};

// The store: a FileStore at o.store_path, or the TCPStore node 0 serves.
c10::intrusive_ptr<c10d::Store> openStore(const NodeOptions& o, const Deadline& deadline) {
  if (!o.store_path.empty()) return c10::make_intrusive<c10d::FileStore>(o.store_path, o.nodes);
  c10d::TCPStoreOptions t;
  t.port = static_cast<std::uint16_t>(o.master_port);
  t.isServer = o.node_rank == 0 && !o.external_store;
  t.numWorkers = o.nodes;
  t.waitWorkers = false;  // the barrier in the constructor waits, with the deadline
  // c10d's client gives up connecting up to a second or two before its
  // timeout; a node 0 that starts late still counts until ours.
  for (;;) {
    t.timeout = deadline.left();
    try {
      return c10::make_intrusive<c10d::TCPStore>(o.master_addr, t);
    } catch (const std::exception&) {
      if (t.isServer || deadline.left() < std::chrono::milliseconds(100)) throw;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
}

// c10d's group (the start-up exchanges, the checksums) and the step's own gloo
// context, both over `store`; the deadline's rest for each.
void connectGroups(const NodeOptions& o, const c10::intrusive_ptr<c10d::Store>& store,
                   c10d::Store& base, const Deadline& deadline,
                   c10::intrusive_ptr<c10d::ProcessGroupGloo>& group,
                   std::shared_ptr<::gloo::rendezvous::Context>& context) {
  auto options = c10d::ProcessGroupGloo::Options::create(o.timeout);
  options->devices.push_back(o.interface.empty()
                                 ? c10d::ProcessGroupGloo::createDefaultDevice()
                                 : c10d::ProcessGroupGloo::createDeviceForInterface(o.interface));
  options->threads = 2;
  group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, o.node_rank, o.nodes, options);
  base.setTimeout(deadline.left());
  GlooStore step_store(c10::make_intrusive<c10d::PrefixStore>("step", store));
  context = std::make_shared<::gloo::rendezvous::Context>(o.node_rank, o.nodes);
  context->setTimeout(deadline.left());
  context->connectFullMesh(step_store, options->devices.front());
  context->setTimeout(o.timeout);
}
}  // namespace

NodeGroup::NodeGroup(const NodeOptions& o)
    : impl_(std::make_unique<Impl>()), rank_(o.node_rank), size_(o.nodes), timeout_(o.timeout) {
  // The rendezvous as a whole honours o.timeout: each of its stages (the store,
  // c10d's group, the step's gloo mesh) gets what is left of it.
  const Deadline deadline{SteadyClock::now() + o.timeout};
  try {
    c10::intrusive_ptr<c10d::Store> base = openStore(o, deadline);
    // Every node arrives, or none proceeds: a barrier on the store, within the
    // deadline. After it c10d's group and the gloo mesh connect to nodes known
    // to be there.
    base->setTimeout(deadline.left());
    base->set(fmt::format("{}/arrived/{}", o.store_prefix, o.node_rank),
              std::vector<std::uint8_t>{1});
    std::vector<std::string> arrived;
    for (int r = 0; r < o.nodes; ++r)
      arrived.push_back(fmt::format("{}/arrived/{}", o.store_prefix, r));
    base->wait(arrived, deadline.left());
    base->setTimeout(deadline.left());
    impl_->store = c10::make_intrusive<c10d::PrefixStore>(o.store_prefix, base);
    connectGroups(o, impl_->store, *base, deadline, impl_->group, impl_->context);
    base->setTimeout(deadline.left());  // the start-up exchanges; endRendezvous() restores it
    impl_->base = base;
  } catch (const std::exception& e) {
    throw NodeFailed(
        fmt::format("gradagg: node {} of {}: rendezvous through {} failed within {} ms: {}",
                    o.node_rank, o.nodes,
                    o.store_path.empty()
                        ? fmt::format("TCPStore {}:{}", o.master_addr, o.master_port)
                        : "FileStore " + o.store_path,
                    o.timeout.count(), message(e)),
        o.node_rank);
  }
}

void NodeGroup::endRendezvous() { impl_->base->setTimeout(timeout_); }

NodeGroup::~NodeGroup() = default;

void NodeGroup::fail(const char* what, const std::exception& e) const {
  throw NodeFailed(fmt::format("gradagg: node {} of {}: {} failed (a peer node died, stalled "
                               "past {} ms, or disagrees): {}",
                               rank_, size_, what, timeout_.count(), message(e)),
                   rank_);
}

template <typename F>
auto NodeGroup::guarded(const char* what, F&& f) const -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    fail(what, e);
  }
}

void NodeGroup::allreduceSum(at::Tensor& t, const char* what) {
  guarded(what, [&] {
    std::vector<at::Tensor> tensors{t};
    impl_->group->allreduce(tensors)->wait(timeout_);
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
  guarded(what, [&] {
    for (const int h : handles) ::gloo::allreduce(*impl_->sums[static_cast<std::size_t>(h)]);
  });
}

void NodeGroup::broadcastFromNode0(at::Tensor& t, const char* what) {
  guarded(what, [&] {
    std::vector<at::Tensor> tensors{t};
    impl_->group->broadcast(tensors)->wait(timeout_);
  });
}

std::vector<std::int64_t> NodeGroup::allgather(std::int64_t value, const char* what) {
  return guarded(what, [&] {
    std::vector<at::Tensor> input{at::full({1}, value, at::kLong)};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int r = 0; r < size_; ++r) output[0].push_back(at::empty({1}, at::kLong));
    impl_->group->allgather(output, input)->wait(timeout_);
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
