#include "topology/startup/rendezvous_store.h"

#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "runtime/interrupt.h"

namespace gradagg::detail {

std::chrono::milliseconds Deadline::left() const {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(at - SteadyClock::now()));
}

void throwIfStopped(const Deadline& deadline, const std::string& what, std::int64_t began) {
  if (interruptDue(began))
    throw std::runtime_error(fmt::format("interrupted while waiting for {}", what));
  if (deadline.passed()) throw std::runtime_error(fmt::format("timed out waiting for {}", what));
}

RendezvousStore::RendezvousStore(c10::intrusive_ptr<c10d::Store> base, Deadline deadline)
    : base_(std::move(base)), deadline_(deadline) {}

void RendezvousStore::close() {
  c10::intrusive_ptr<c10d::Store> gone;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    gone = std::move(base_);
  }
}

c10::intrusive_ptr<c10d::Store> RendezvousStore::base() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!base_)
    throw std::runtime_error("gradagg: the rendezvous store is closed after the start-up");
  return base_;
}

void RendezvousStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  base()->set(key, value);
}

std::vector<uint8_t> RendezvousStore::compareSet(const std::string& key,
                                                 const std::vector<uint8_t>& expected,
                                                 const std::vector<uint8_t>& desired) {
  return base()->compareSet(key, expected, desired);
}

std::vector<uint8_t> RendezvousStore::get(const std::string& key) {
  wait({key});
  return base()->get(key);
}

int64_t RendezvousStore::add(const std::string& key, int64_t value) {
  return base()->add(key, value);
}

bool RendezvousStore::deleteKey(const std::string& key) { return base()->deleteKey(key); }

bool RendezvousStore::check(const std::vector<std::string>& keys) { return base()->check(keys); }

int64_t RendezvousStore::getNumKeys() { return base()->getNumKeys(); }

void RendezvousStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void RendezvousStore::wait(const std::vector<std::string>& keys,
                           const std::chrono::milliseconds& timeout) {
  const Deadline until{std::min(deadline_.at, SteadyClock::now() + timeout)};
  const auto store = base();
  pollUntil(until, fmt::format("the store keys {}", fmt::join(keys, ", ")),
            [&] { return store->check(keys); });
}

}  // namespace gradagg::detail
