#include "step/message.h"

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <gradagg/errors.h>

#include "runtime/segment.h"  // kAlign, alignUp

namespace gradagg {

Message::Message(std::initializer_list<std::pair<std::string, at::Tensor>> tensors) {
  for (const auto& [name, tensor] : tensors) set(name, tensor);
}

Message& Message::set(Entry entry) {
  for (Entry& e : entries_)
    if (e.name == entry.name) {
      e = std::move(entry);
      return *this;
    }
  entries_.push_back(std::move(entry));
  return *this;
}

Message& Message::set(const std::string& name, at::Tensor value) {
  return set(Entry{name, std::move(value), false});
}

Message& Message::set(const std::string& name, double number) {
  return set(Entry{name, at::scalar_tensor(number, at::kDouble), true});
}

Message& Message::set(const std::string& name, std::int64_t number) {
  return set(Entry{name, at::scalar_tensor(number, at::kLong), true});
}

const Message::Entry* Message::find(const std::string& name) const {
  for (const Entry& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

const at::Tensor& Message::at(const std::string& name) const {
  if (const Entry* e = find(name)) return e->tensor;
  std::vector<std::string> names;
  for (const Entry& e : entries_) names.push_back("'" + e.name + "'");
  throw InvalidArgument(
      fmt::format("the step's message has no '{}' (it has {})", name,
                  names.empty() ? "nothing" : fmt::format("{}", fmt::join(names, ", "))));
}

}  // namespace gradagg

namespace gradagg::detail {

namespace {
std::uint64_t entriesEnd(std::size_t count) {
  return alignUp(sizeof(MessageTable) + sizeof(MessageEntry) * count, kAlign);
}

void checkEntry(const Message::Entry& e) {
  if (e.name.empty() || e.name.size() > Message::kMaxNameBytes)
    throw InvalidArgument(fmt::format("message entry '{}': a name of 1..{} bytes expected", e.name,
                                      Message::kMaxNameBytes));
  const at::Tensor& t = e.tensor;
  if (!t.defined())
    throw InvalidArgument(fmt::format("message entry '{}': an undefined tensor", e.name));
  if (!t.device().is_cpu() || t.layout() != at::kStrided)
    throw InvalidArgument(
        fmt::format("message entry '{}': expected a dense CPU tensor, got a {} tensor on {}",
                    e.name, t.is_sparse() ? "sparse" : "non-strided", t.device().str()));
  if (t.dim() > Message::kMaxDims)
    throw InvalidArgument(fmt::format("message entry '{}': {} dimensions, at most {} travel",
                                      e.name, t.dim(), Message::kMaxDims));
}
}  // namespace

std::uint64_t messageBytes(const Message& message) {
  std::uint64_t end = entriesEnd(message.size());
  for (const Message::Entry& e : message.entries()) {
    checkEntry(e);
    end = alignUp(end + e.tensor.numel() * e.tensor.element_size(), kAlign);
  }
  return end;
}

MessageWriter::MessageWriter(std::byte* region, std::uint64_t capacity)
    : region_(region), capacity_(capacity) {}

void MessageWriter::write(const Message& message) {
  auto* table = reinterpret_cast<MessageTable*>(region_);
  if (message.empty()) {
    if (table->count != 0) *table = MessageTable{0, 0, sizeof(MessageTable)};
    return;
  }
  const std::uint64_t bytes = messageBytes(message);
  if (bytes > capacity_)
    throw InvalidArgument(fmt::format(
        "the step's message takes {} bytes ({} entries), more than the {} bytes of room "
        "(Options::message_bytes, fixed at construction)",
        bytes, message.size(), capacity_));
  auto* entries = reinterpret_cast<MessageEntry*>(region_ + sizeof(MessageTable));
  std::uint64_t offset = entriesEnd(message.size());
  for (std::size_t i = 0; i < message.size(); ++i) {
    const Message::Entry& e = message.entries()[i];
    MessageEntry& out = entries[i];
    std::memset(&out, 0, sizeof(out));
    std::memcpy(out.name, e.name.data(), e.name.size());
    const at::Tensor& t = e.tensor;
    out.dtype = static_cast<std::int8_t>(t.scalar_type());
    out.number = e.number ? 1 : 0;
    out.dims = static_cast<std::uint8_t>(t.dim());
    for (int d = 0; d < t.dim(); ++d) out.sizes[d] = t.size(d);
    out.offset = offset;
    out.bytes = static_cast<std::uint64_t>(t.numel()) * t.element_size();
    if (out.bytes > 0 && t.is_contiguous()) {
      std::memcpy(region_ + offset, t.data_ptr(), out.bytes);  // the common case: one memcpy
    } else if (out.bytes > 0) {
      at::Tensor dst = at::from_blob(region_ + offset, t.sizes(), t.options());
      dst.copy_(t);  // a view: gathered into place
    }
    offset = alignUp(offset + out.bytes, kAlign);
  }
  *table = MessageTable{static_cast<std::uint32_t>(message.size()), 0, offset};
}

void readMessage(const std::byte* region, Message& out) {
  out.clear();
  const auto* table = reinterpret_cast<const MessageTable*>(region);
  const auto* entries = reinterpret_cast<const MessageEntry*>(region + sizeof(MessageTable));
  for (std::uint32_t i = 0; i < table->count; ++i) {
    const MessageEntry& e = entries[i];
    const auto dtype = static_cast<c10::ScalarType>(e.dtype);
    at::Tensor view =
        at::from_blob(const_cast<std::byte*>(region + e.offset), at::IntArrayRef(e.sizes, e.dims),
                      at::TensorOptions().dtype(dtype));
    out.set(Message::Entry{std::string(e.name, ::strnlen(e.name, sizeof(e.name))), std::move(view),
                           e.number != 0});
  }
}

}  // namespace gradagg::detail
