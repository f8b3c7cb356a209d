#include "gloo_peer.h"

#include <stdexcept>
#include <vector>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace gradagg::bench {

struct GlooPeer::Impl {
  int rank;
  int size;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
};

GlooPeer::GlooPeer(const Options& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size)
    throw std::invalid_argument("GlooPeer: rank " + std::to_string(options.rank) +
                                " is not in [0, " + std::to_string(options.size) + ")");
  auto store = c10::make_intrusive<c10d::FileStore>(options.store_path, options.size);
  auto pg_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  pg_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options.hostname));
  pg_options->threads = options.threads;
  impl_ = std::make_unique<Impl>();
  impl_->rank = options.rank;
  impl_->size = options.size;
  impl_->group =
      c10::make_intrusive<c10d::ProcessGroupGloo>(store, options.rank, options.size, pg_options);
}

GlooPeer::~GlooPeer() = default;
GlooPeer::GlooPeer(GlooPeer&&) noexcept = default;
GlooPeer& GlooPeer::operator=(GlooPeer&&) noexcept = default;

void GlooPeer::allreduceSum(at::Tensor& t) {
  if (impl_->size == 1) return;
  std::vector<at::Tensor> tensors{t};
  impl_->group->allreduce(tensors)->wait();
}

void GlooPeer::barrier() {
  if (impl_->size == 1) return;
  impl_->group->barrier()->wait();
}

int GlooPeer::rank() const noexcept { return impl_->rank; }
int GlooPeer::size() const noexcept { return impl_->size; }

}  // namespace gradagg::bench
