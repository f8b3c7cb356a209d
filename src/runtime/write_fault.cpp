#include "runtime/write_fault.h"

#include <signal.h>

#include <cstring>

namespace gradagg::detail {

namespace {
// One region per process (a worker has one snapshot); set before the handler.
const std::byte* g_begin = nullptr;
std::size_t g_bytes = 0;
std::atomic<std::int64_t>* g_offset = nullptr;
struct sigaction g_previous;

void onSegv(int, siginfo_t* info, void*) {
  const bool fault = info->si_code > 0;  // from the kernel, not kill() or raise()
  const auto* addr = static_cast<const std::byte*>(info->si_addr);
  if (fault && addr >= g_begin && addr < g_begin + g_bytes)
    g_offset->store(addr - g_begin, std::memory_order_relaxed);
  // Hand the signal back (async-signal-safe calls only): a fault's instruction
  // runs again and meets the previous disposition; a sent signal is sent again.
  sigaction(SIGSEGV, &g_previous, nullptr);
  if (!fault) raise(SIGSEGV);
}
}  // namespace

void reportWriteFaults(const std::byte* begin, std::size_t bytes,
                       std::atomic<std::int64_t>* offset) {
  g_begin = begin;
  g_bytes = bytes;
  g_offset = offset;
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_sigaction = onSegv;
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &g_previous);
}

}  // namespace gradagg::detail
