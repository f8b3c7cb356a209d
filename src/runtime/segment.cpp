#include "runtime/segment.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <fmt/os.h>
#include <boost/interprocess/anonymous_shared_memory.hpp>

#include "runtime/check.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace gradagg::detail {

std::size_t pageBytes() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

Segment Segment::createAnonymous(std::size_t bytes) {
  GRADAGG_ENFORCE(bytes > 0 && bytes % pageBytes() == 0, "segment of {} bytes", bytes);
  boost::interprocess::mapped_region region;
  try {
    region = boost::interprocess::anonymous_shared_memory(bytes);
  } catch (const boost::interprocess::interprocess_exception& e) {
    throw std::system_error(
        std::error_code(e.get_native_error(), std::generic_category()),
        fmt::format("gradagg: cannot map a shared segment of {} bytes: {}", bytes, e.what()));
  }
  // Reserve the pages now. MADV_POPULATE_WRITE (Linux 5.14) fails with ENOMEM
  // instead of raising SIGBUS later; older kernels say EINVAL and we touch the
  // pages ourselves (which still moves any SIGBUS to this point, before fork).
  if (::madvise(region.get_address(), bytes, MADV_POPULATE_WRITE) != 0) {
    const int err = errno;
    if (err != EINVAL)
      throw fmt::system_error(err, "gradagg: cannot reserve {} bytes of shared memory", bytes);
    std::memset(region.get_address(), 0, bytes);
  }
  return Segment(std::move(region));
}

void Segment::protectReadOnly(const std::byte* begin, std::size_t bytes) const {
  const std::size_t page = pageBytes();
  const auto offset = static_cast<std::size_t>(begin - base());
  GRADAGG_ENFORCE(offset % page == 0 && offset + bytes <= size(), "protect [{}, +{})", offset,
                  bytes);
  const std::size_t len = (bytes + page - 1) / page * page;
  if (len == 0) return;
  if (::mprotect(base() + offset, len, PROT_READ) != 0)
    throw fmt::system_error(errno, "gradagg: mprotect of the snapshot");
}

}  // namespace gradagg::detail
