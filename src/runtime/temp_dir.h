// TempDir: a fresh directory, removed with everything in it when its owner goes.
// For gradagg's tests and bench (FileStore rendezvous, checkpoints, data files);
// header-only, not part of the library.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace gradagg::detail {

class TempDir {
 public:
  // mkdtemp of $TMPDIR/gradagg-<tag>-XXXXXX (or gradagg-XXXXXX), /tmp when TMPDIR
  // is unset or empty. Throws std::system_error with mkdtemp's errno.
  explicit TempDir(std::string_view tag = {}) : creator_(::getpid()) {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = base != nullptr && *base != '\0' ? base : "/tmp";
    pattern += "/gradagg-";
    if (!tag.empty()) pattern.append(tag).append("-");
    pattern += "XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr)
      throw std::system_error(errno, std::generic_category(), "gradagg: mkdtemp " + pattern);
    path_ = std::move(pattern);
  }

  // Removes the directory and its contents; only in the process that created it
  // (a forked child that unwinds a copy of this object leaves it alone). Errors
  // are ignored: a destructor does not throw.
  ~TempDir() { remove(); }

  TempDir(TempDir&& other) noexcept
      : path_(std::exchange(other.path_, {})), creator_(other.creator_) {}
  TempDir& operator=(TempDir&& other) noexcept {
    if (this != &other) {
      remove();
      path_ = std::exchange(other.path_, {});
      creator_ = other.creator_;
    }
    return *this;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // The directory; empty after a move from this object.
  const std::string& path() const noexcept { return path_; }
  // path()/name: an entry of the directory (not created).
  std::string file(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  void remove() noexcept {
    if (path_.empty() || ::getpid() != creator_) return;
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
    path_.clear();
  }

  std::string path_;
  pid_t creator_;
};

}  // namespace gradagg::detail
