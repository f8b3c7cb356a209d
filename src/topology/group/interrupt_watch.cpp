#include "topology/group/interrupt_watch.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>

#include "runtime/interrupt.h"

namespace gradagg::detail {

InterruptWatch::InterruptWatch(Sockets group) : group_(std::move(group)) {
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      wake_.wait_for(lock, std::chrono::milliseconds(10));
      // No wait in progress: one that began now (due at once without patience).
      const std::int64_t oldest =
          waits_.empty() ? monotonicNowNs() : *std::min_element(waits_.begin(), waits_.end());
      if (stopping_ || done_ || !interruptDue(oldest)) continue;
      lock.unlock();
      shutDown(true);
      lock.lock();
    }
  });
}

InterruptWatch::~InterruptWatch() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

InterruptWatch::Wait::Wait(InterruptWatch& watch) : watch_(watch), began_(monotonicNowNs()) {
  std::lock_guard<std::mutex> lock(watch_.mutex_);
  watch_.waits_.push_back(began_);
}

InterruptWatch::Wait::~Wait() {
  std::lock_guard<std::mutex> lock(watch_.mutex_);
  auto& waits = watch_.waits_;
  waits.erase(std::find(waits.begin(), waits.end(), began_));
}

bool InterruptWatch::interrupted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return interrupted_;
}

void InterruptWatch::shutDown(bool interrupted) noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    done_ = true;
    interrupted_ = interrupted;
  }
  for (const auto& [fd, inode] : group_.open) {
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_ino == inode) ::shutdown(fd, SHUT_RDWR);
  }
}

}  // namespace gradagg::detail
