// The notes of model/resumed.h: a short list under a mutex, looked at once per
// step (an atomic count spares the lock while it is empty).
#include "model/resumed.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

namespace gradagg::detail {

namespace {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// A model's identity: its parameters' and buffers' TensorImpls, in order.
struct Note {
  std::vector<WeakImpl> keys;  // held weakly: the addresses stay taken while noted
  std::vector<const c10::TensorImpl*> impls;
  Resumed resumed;
};

std::mutex g_mutex;
std::vector<Note>* g_notes = new std::vector<Note>;  // never destroyed: used until exit
std::atomic<int> g_count{0};

std::vector<const c10::TensorImpl*> implsOf(const ModelView& model) {
  std::vector<const c10::TensorImpl*> out;
  for (const auto* list : {&model.parameters, &model.buffers})
    for (const NamedTensor& t : *list)
      if (t.tensor.defined()) out.push_back(t.tensor.unsafeGetTensorImpl());
  return out;
}

bool expired(const Note& n) {
  return std::any_of(n.keys.begin(), n.keys.end(), [](const WeakImpl& k) { return k.expired(); });
}

// Drops the notes of models that are gone; the caller holds g_mutex.
void prune() {
  auto& notes = *g_notes;
  notes.erase(std::remove_if(notes.begin(), notes.end(), expired), notes.end());
  g_count.store(static_cast<int>(notes.size()), std::memory_order_release);
}

std::vector<Note>::iterator find(const std::vector<const c10::TensorImpl*>& impls) {
  return std::find_if(g_notes->begin(), g_notes->end(),
                      [&](const Note& n) { return n.impls == impls && !expired(n); });
}

}  // namespace

void noteResumed(const ModelView& model, Resumed resumed) {
  auto impls = implsOf(model);
  if (impls.empty()) return;
  resumed.seed = at::detail::getDefaultCPUGenerator().current_seed();
  std::lock_guard<std::mutex> lock(g_mutex);
  prune();
  const auto it = find(impls);
  if (it != g_notes->end()) {
    it->resumed = std::move(resumed);
    return;
  }
  Note note;
  for (const auto* list : {&model.parameters, &model.buffers})
    for (const NamedTensor& t : *list)
      if (t.tensor.defined()) note.keys.emplace_back(t.tensor.getIntrusivePtr());
  note.impls = std::move(impls);
  note.resumed = std::move(resumed);
  g_notes->push_back(std::move(note));
  g_count.store(static_cast<int>(g_notes->size()), std::memory_order_release);
}

std::optional<Resumed> peekResumed(const ModelView& model) {
  if (g_count.load(std::memory_order_acquire) == 0) return std::nullopt;
  const auto impls = implsOf(model);
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto it = find(impls);
  if (it == g_notes->end()) return std::nullopt;
  return it->resumed;
}

std::optional<Resumed> takeResumed(const ModelView& model) {
  if (g_count.load(std::memory_order_acquire) == 0) return std::nullopt;
  const auto impls = implsOf(model);
  std::lock_guard<std::mutex> lock(g_mutex);
  std::optional<Resumed> out;
  const auto it = find(impls);
  if (it != g_notes->end()) {
    out = std::move(it->resumed);
    g_notes->erase(it);
  }
  prune();
  return out;
}

}  // namespace gradagg::detail
