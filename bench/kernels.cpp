#include "kernels.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "step/flat.h"  // gradagg/src: the library's reduction

namespace gradagg::bench {

namespace {

// n persistent participants (this thread and n - 1 others) that each run part r
// of a job, as the n workers each reduce their own range every step. Between
// jobs the threads spin (yielding) for up to kSpin, as the workers do between
// steps, so back-to-back calls time the kernel, not wake-ups; then they sleep.
// (The pool outlives the reduce-only rows: threads that yielded for ever took
// 20-45% of a core from every row the bench ran after them.)
class PartPool {
 public:
  explicit PartPool(int n) : n_(n) {
    for (int r = 1; r < n_; ++r) threads_.emplace_back([this, r] { serve(r); });
  }
  ~PartPool() {
    stop_ = true;
    publish();
    for (auto& t : threads_) t.join();
  }
  int size() const { return n_; }

  void run(const std::function<void(int)>& part) {
    part_ = &part;
    pending_.store(n_ - 1);
    publish();
    part(0);
    while (pending_.load() != 0) std::this_thread::yield();
  }

 private:
  static constexpr std::chrono::microseconds kSpin{200};

  // A new job (or the stop): under the mutex, so a sleeping thread cannot miss it.
  void publish() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
  }

  unsigned awaitJob(unsigned seen) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (generation_.load() == seen && std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return generation_.load() != seen; });
    return generation_.load();
  }

  void serve(int r) {
    unsigned seen = 0;
    for (;;) {
      seen = awaitJob(seen);
      if (stop_) return;
      (*part_)(r);
      pending_.fetch_sub(1);
    }
  }

  const int n_;
  std::vector<std::thread> threads_;
  std::atomic<unsigned> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* part_ = nullptr;
  std::mutex mutex_;
  std::condition_variable wake_;
};

PartPool& pool(int n) {
  static std::unique_ptr<PartPool> p;
  if (!p || p->size() != n) p = std::make_unique<PartPool>(n);
  return *p;
}

}  // namespace

void reduceSlots(detail::ElementType type, void* out, const void* const* slots,
                 const double* weights, int n, std::size_t count) {
  const std::vector<detail::FlatTensor> flat{{0, count, type}};
  const auto ranges = detail::splitRanges(count * detail::elementBytes(type), n);
  std::vector<const std::byte*> views;
  for (int i = 0; i < n; ++i) views.push_back(static_cast<const std::byte*>(slots[i]));
  pool(n).run([&](int r) {
    detail::reduceRange(flat, ranges[r], reinterpret_cast<std::byte*>(out), views.data(), weights,
                        n);
  });
}

void streamAdd(float* c, const float* a, const float* b, std::size_t count, int n) {
  pool(n).run([&](int r) {
    const std::size_t begin = count * r / n, end = count * (r + 1) / n;
    float* __restrict cc = c;
    const float* __restrict aa = a;
    const float* __restrict bb = b;
    for (std::size_t k = begin; k < end; ++k) cc[k] = aa[k] + bb[k];
  });
}

}  // namespace gradagg::bench
