// Segment: the one owner of the shared mapping (like fmt::file owns a descriptor).
#pragma once

#include <cstddef>

#include <boost/interprocess/mapped_region.hpp>

namespace gradagg::detail {

// Every region of a segment starts on its own cache line.
inline constexpr std::size_t kAlign = 64;
constexpr std::size_t alignUp(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }
// Room for one process's error message in a segment (NUL-terminated).
inline constexpr std::size_t kMessageBytes = 1024;

class Segment {
 public:
  Segment() = default;
  // Maps `bytes` of anonymous shared memory (never named, so nothing can appear
  // in /dev/shm) and reserves every page now: a shortage of memory is a
  // std::system_error here, not a SIGBUS on first touch in the middle of a run.
  // The pages read as zero.
  static Segment createAnonymous(std::size_t bytes);

  Segment(Segment&&) noexcept = default;
  Segment& operator=(Segment&&) noexcept = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() = default;  // the mapped_region unmaps

  std::byte* base() const noexcept { return static_cast<std::byte*>(region_.get_address()); }
  std::size_t size() const noexcept { return region_.get_size(); }
  explicit operator bool() const noexcept { return base() != nullptr; }

  // Makes [begin, begin + bytes) of this process's view read-only (page-aligned).
  void protectReadOnly(const std::byte* begin, std::size_t bytes) const;

 private:
  explicit Segment(boost::interprocess::mapped_region region) : region_(std::move(region)) {}
  boost::interprocess::mapped_region region_;
};

std::size_t pageBytes();

}  // namespace gradagg::detail
