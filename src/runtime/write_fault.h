// A worker's last words when it writes into memory it may only read (the
// snapshot: the parent's parameters and buffers, mapped read-only in workers).
// The kernel kills it with SIGSEGV either way; this handler first stores where
// in the region the write hit, so the parent can name the parameter.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace gradagg::detail {

// In a worker, once: a SIGSEGV whose address lies in [begin, begin + bytes)
// stores its offset there into `*offset`; then the previous handler (the
// default: death by SIGSEGV, or a sanitizer's report) takes the signal as if
// this one were not there. Any other SIGSEGV goes straight to it.
void reportWriteFaults(const std::byte* begin, std::size_t bytes,
                       std::atomic<std::int64_t>* offset);

}  // namespace gradagg::detail
