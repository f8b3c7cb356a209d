// Files that survive a crash or a full disk whole or not at all, and are read
// back only when intact: the envelope of every checkpoint gradagg writes
// (gradagg::Checkpoint, Population::checkpoint).
//
//   offset  0  16 bytes  "GRADAGG CKPT v1\n"
//   offset 16  u64       payload length in bytes (little endian)
//   offset 24  u64       CRC-64/XZ of the payload
//   offset 32  payload
//
// Any single-bit flip is caught: in the magic (not a checkpoint), in the length
// (it no longer matches the file's size), in the CRC or the payload (a CRC-64
// detects every error burst up to 64 bits). Every failure is a CheckpointError
// naming the file.
#pragma once

#include <cstdint>
#include <string>

namespace gradagg::detail {

// The "format" entry of each kind of payload (a torch::serialize archive), so
// that one kind given where the other is expected is refused by name.
inline constexpr const char* kCheckpointFormat = "gradagg-checkpoint/1";  // gradagg::Checkpoint
inline constexpr const char* kPopulationFormat = "gradagg-population/1";  // Population::checkpoint

// Throws CheckpointError when `path` is empty or a directory, or its directory is
// missing or does not accept a new file (a probe file is created and removed).
void checkWritable(const std::string& path);

// Writes header + payload to "<path>.tmp-<pid>.<n>" (n: this process's n-th
// write, so concurrent writes of one path never share a file), fsyncs and
// closes it, renames it over `path` and fsyncs the directory. On any failure the
// temporary file is removed and `path` keeps what it had. SIGXFSZ is ignored
// while writing, so a file-size limit is an error (EFBIG), not a core dump.
// Afterwards, "<path>.tmp-<pid>[.<n>]" files of processes that no longer exist are
// removed (left by a writer killed mid-save): at once where this process holds
// the path's CheckpointLock (no other run writes it), else once 10 minutes old.
void writeDurably(const std::string& path, const std::string& payload);

// This process holds the CheckpointLock of `checkpoint_path` (checkpoint_lock.cpp).
bool holdsCheckpointLock(const std::string& checkpoint_path);

// The payload of `path`, verified (magic, length, CRC). `crc` receives its CRC.
// The header is checked before the content is read: a file that is not a
// checkpoint, or not of its header's size, is refused without reading it.
std::string readVerified(const std::string& path, std::uint64_t* crc = nullptr);

}  // namespace gradagg::detail
