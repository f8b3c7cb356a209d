// A message: what the parent hands its workers with one step (batch indices, a
// refilled tensor, a learning-rate factor, ...). The workers were forked once
// and see the parent's memory as it was then; a message is how anything the
// parent decides later reaches them.
//
//   gradagg::Message m;
//   m.set("indices", sampler.next(global_batch));   // any dense CPU tensor
//   m.set("epoch", epoch);                          // a number: a 0-dim tensor
//   agg.step(m);
//   ...
//   // in the shard function:
//   const at::Tensor& idx = ctx.message.at("indices");
//
// step() copies the tensors' bytes into the segment with the step's command;
// the message is then free to change. In the worker, ctx.message holds
// read-only views of that copy, valid during the shard function's call; a
// redone or restarted step sees the same message.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace gradagg {

class Message {
 public:
  struct Entry {
    std::string name;
    at::Tensor tensor;
    bool number = false;  // set from a number (Python reads an int or float back)
  };

  Message() = default;
  Message(std::initializer_list<std::pair<std::string, at::Tensor>> tensors);

  // Adds or replaces `name` (at most kMaxNameBytes bytes). A tensor must be a
  // dense CPU tensor of at most kMaxDims dimensions (any dtype; a view is
  // copied as a contiguous tensor); step() checks it and throws InvalidArgument.
  Message& set(const std::string& name, at::Tensor value);
  Message& set(const std::string& name, double number);        // 0-dim float64
  Message& set(const std::string& name, std::int64_t number);  // 0-dim int64
  Message& set(const std::string& name, int number) {
    return set(name, static_cast<std::int64_t>(number));
  }
  Message& set(Entry entry);

  // The tensor named `name`; InvalidArgument naming it and the names there are
  // when there is none.
  const at::Tensor& at(const std::string& name) const;
  const Entry* find(const std::string& name) const;
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  const std::vector<Entry>& entries() const { return entries_; }
  std::size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  void clear() { entries_.clear(); }

  static constexpr std::size_t kMaxNameBytes = 63;
  static constexpr int kMaxDims = 8;

 private:
  std::vector<Entry> entries_;  // in the order they were first set
};

}  // namespace gradagg
