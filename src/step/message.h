// A step's message in the segment (gradagg/message.h): the parent writes it
// with the step's command, the workers read it as ctx.message.
//
//   message_offset  +--------------------------------------------+
//                   | MessageTable: count, bytes used            |
//                   | MessageEntry[0..count-1]: name, dtype,     |
//                   |   sizes, where its bytes lie               |
//                   | data: each entry's bytes, 64-byte aligned  |
//                   +--------------------------------------------+
//
// Written by the parent only, while every worker is idle (before it bumps
// command_seq), and only when the message differs from the one there (an
// empty message after an empty one writes nothing). Read by the workers after
// they saw the command; mapped read-only in them. A redone or restarted step
// finds it as it was.
#pragma once

#include <cstddef>
#include <cstdint>

#include <gradagg/message.h>

namespace gradagg::detail {

struct MessageTable {
  std::uint32_t count;  // entries
  std::uint32_t unused;
  std::uint64_t bytes;  // the table, the entries and the data
};

struct MessageEntry {
  char name[Message::kMaxNameBytes + 1];  // NUL-terminated
  std::int8_t dtype;                      // a c10::ScalarType
  std::uint8_t number;                    // Message::Entry::number
  std::uint8_t dims;
  std::uint8_t unused[5];
  std::uint64_t offset;  // of its bytes, from the start of the region
  std::uint64_t bytes;
  std::int64_t sizes[Message::kMaxDims];
};
static_assert(sizeof(MessageEntry) == 152 && sizeof(MessageTable) == 16);

// The bytes `message` takes in the region; throws InvalidArgument naming the
// entry that cannot travel (a CUDA or sparse tensor, too many dimensions, a
// name too long).
std::uint64_t messageBytes(const Message& message);

// The parent's side.
class MessageWriter {
 public:
  MessageWriter(std::byte* region, std::uint64_t capacity);
  // Checks that `message` fits (InvalidArgument naming its size and the
  // room, Options::message_bytes) and copies it into the region. An empty
  // message over an empty region writes nothing.
  void write(const Message& message);

 private:
  std::byte* region_;
  std::uint64_t capacity_;
};

// The worker's side: `out` gets views of the region's tensors (read-only
// memory in workers). No allocation when the message is empty.
void readMessage(const std::byte* region, Message& out);

}  // namespace gradagg::detail
