// The notes of model/resumed.h: a short list under a mutex, looked at once per
// step (an atomic count spares the lock while it is empty).
#include "model/resumed.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

namespace gradagg::detail {

namespace {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Note {
  WeakImpl key;
  const c10::TensorImpl* impl;
  Resumed resumed;
};

std::mutex g_mutex;
std::vector<Note>* g_notes = new std::vector<Note>;  // never destroyed: used until exit
std::atomic<int> g_count{0};

const at::Tensor* keyOf(const ModelView& model) {
  if (!model.parameters.empty()) return &model.parameters.front().tensor;
  if (!model.buffers.empty()) return &model.buffers.front().tensor;
  return nullptr;
}

// Drops the notes of models that are gone; the caller holds g_mutex.
void prune() {
  auto& notes = *g_notes;
  notes.erase(std::remove_if(notes.begin(), notes.end(),
                             [](const Note& n) { return n.key.expired(); }),
              notes.end());
}

std::vector<Note>::iterator find(const c10::TensorImpl* impl) {
  return std::find_if(g_notes->begin(), g_notes->end(),
                      [&](const Note& n) { return n.impl == impl; });
}

}  // namespace

void noteResumed(const ModelView& model, Resumed resumed) {
  const at::Tensor* key = keyOf(model);
  if (key == nullptr || !key->defined()) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  prune();
  const auto it = find(key->unsafeGetTensorImpl());
  if (it != g_notes->end()) it->resumed = std::move(resumed);
  else g_notes->push_back(Note{WeakImpl(key->getIntrusivePtr()), key->unsafeGetTensorImpl(),
                               std::move(resumed)});
  g_count.store(static_cast<int>(g_notes->size()), std::memory_order_release);
}

std::optional<Resumed> peekResumed(const ModelView& model) {
  if (g_count.load(std::memory_order_acquire) == 0) return std::nullopt;
  const at::Tensor* key = keyOf(model);
  if (key == nullptr || !key->defined()) return std::nullopt;
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto it = find(key->unsafeGetTensorImpl());
  if (it == g_notes->end() || it->key.expired()) return std::nullopt;
  return it->resumed;
}

std::optional<Resumed> takeResumed(const ModelView& model) {
  if (g_count.load(std::memory_order_acquire) == 0) return std::nullopt;
  const at::Tensor* key = keyOf(model);
  if (key == nullptr || !key->defined()) return std::nullopt;
  std::lock_guard<std::mutex> lock(g_mutex);
  prune();
  std::optional<Resumed> out;
  const auto it = find(key->unsafeGetTensorImpl());
  if (it != g_notes->end()) {
    out = std::move(it->resumed);
    g_notes->erase(it);
  }
  g_count.store(static_cast<int>(g_notes->size()), std::memory_order_release);
  return out;
}

}  // namespace gradagg::detail
