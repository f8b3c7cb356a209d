#include "checkpoint/durable_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <utility>

#include <fmt/format.h>
#include <boost/crc.hpp>

#include <gradagg/checkpoint.h>

#include "runtime/signal_blocked.h"

namespace gradagg::detail {

namespace {

constexpr char kMagic[16] = {'G', 'R', 'A', 'D', 'A', 'G', 'G', ' ',
                             'C', 'K', 'P', 'T', ' ', 'v', '1', '\n'};
constexpr std::size_t kHeaderBytes = 32;

using Crc64 = boost::crc_optimal<64, 0x42F0E1EBA9EA3693ull, ~0ull, ~0ull, true, true>;

std::uint64_t crc64(const char* data, std::size_t n) {
  Crc64 crc;
  crc.process_bytes(data, n);
  return crc.checksum();
}

std::string osError(int err) { return std::strerror(err); }

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw CheckpointError(fmt::format("gradagg: checkpoint {}: {}", path, what), path);
}

std::string directoryOf(const std::string& path) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return dir.empty() ? "." : dir;
}

// A file descriptor closed on every path out.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  int release() { return std::exchange(fd, -1); }
};

void writeAll(int fd, const char* data, std::size_t n, const std::string& path,
              const std::string& tmp) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      fail(path, fmt::format("writing {} failed: {}", tmp, osError(w < 0 ? errno : ENOSPC)));
    data += w;
    n -= static_cast<std::size_t>(w);
  }
}

// Reads up to n bytes (fewer only at the end of the file).
std::size_t readUpTo(int fd, char* out, std::size_t n, const std::string& path) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t r = ::read(fd, out + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail(path, fmt::format("reading it failed: {}", osError(errno)));
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return done;
}

// "<path>.tmp-<pid>[.<n>]" files left by writers killed mid-save (kill -9, a power
// cut): removed once their process is gone; at once under the path's lock (no
// other run writes it), else once they are 10 minutes old (a slow writer on
// another host of a shared file system, whose pid means nothing here, keeps
// its file fresh).
void removeOrphans(const std::string& path) {
  const bool locked = holdsCheckpointLock(path);
  namespace fs = std::filesystem;
  const fs::path p(path);
  const std::string prefix = p.filename().string() + ".tmp-";
  std::error_code ec;
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    // "<pid>" or "<pid>.<write>" (the write's number within its process).
    const std::string rest = name.substr(prefix.size());
    const std::string digits = rest.substr(0, rest.find('.'));
    const std::string write = rest.size() > digits.size() ? rest.substr(digits.size() + 1) : "0";
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos ||
        digits.size() > 9 || write.empty() ||
        write.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
    struct stat st {};
    if (!locked && (::stat(it->path().c_str(), &st) != 0 || ::time(nullptr) - st.st_mtime < 600))
      continue;
    ::unlink(it->path().c_str());
  }
}

}  // namespace

void checkWritable(const std::string& path) {
  if (path.empty()) throw CheckpointError("gradagg: checkpoint: the path is empty", path);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) fail(path, "is a directory");
  const std::string dir = directoryOf(path);
  if (::stat(dir.c_str(), &st) != 0)
    fail(path, fmt::format("its directory {} cannot be used: {}", dir, osError(errno)));
  if (!S_ISDIR(st.st_mode)) fail(path, fmt::format("{} is not a directory", dir));
  const std::string probe = fmt::format("{}.probe-{}", path, ::getpid());
  const int fd = ::open(probe.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0)
    fail(path, fmt::format("cannot be written: creating {} failed: {}", probe, osError(errno)));
  ::close(fd);
  ::unlink(probe.c_str());
}

void writeDurably(const std::string& path, const std::string& payload) {
  char header[kHeaderBytes];
  std::memcpy(header, kMagic, sizeof kMagic);
  const std::uint64_t length = payload.size(), crc = crc64(payload.data(), payload.size());
  std::memcpy(header + 16, &length, 8);
  std::memcpy(header + 24, &crc, 8);

  // A temporary file beside it, fsync'ed; removed on any failure. Its own for
  // this write: two threads saving the same path at once each rename a whole
  // file over it (the later wins), never one file both wrote into.
  static std::atomic<std::uint64_t> writes{0};
  const std::string tmp = fmt::format("{}.tmp-{}.{}", path, ::getpid(), writes.fetch_add(1));
  // A file-size limit is EFBIG, not a core dump.
  SignalBlocked no_sigxfsz(SIGXFSZ);
  Fd f;
  f.fd = ::open(tmp.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
  if (f.fd < 0) fail(path, fmt::format("creating {} failed: {}", tmp, osError(errno)));
  try {
    writeAll(f.fd, header, sizeof header, path, tmp);
    writeAll(f.fd, payload.data(), payload.size(), path, tmp);
    if (::fsync(f.fd) != 0) fail(path, fmt::format("fsync of {} failed: {}", tmp, osError(errno)));
    if (::close(f.release()) != 0)
      fail(path, fmt::format("closing {} failed: {}", tmp, osError(errno)));
    // Renamed over the checkpoint, then the directory fsync'ed.
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      fail(path, fmt::format("renaming {} to it failed: {}", tmp, osError(errno)));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  const std::string dir = directoryOf(path);
  Fd d;
  d.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d.fd < 0 || (::fsync(d.fd) != 0 && errno != EINVAL))
    fail(path,
         fmt::format("written, but fsync of its directory {} failed: {}", dir, osError(errno)));
  removeOrphans(path);
}

std::string readVerified(const std::string& path, std::uint64_t* crc_out) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (f.fd < 0 || ::fstat(f.fd, &st) != 0)
    fail(path, fmt::format("cannot be opened: {}", osError(errno)));
  // The header first: nothing is allocated for a file that is not a checkpoint
  // or whose size is not the one its header gives (a huge file is not read).
  char header[kHeaderBytes];
  const std::size_t got = readUpTo(f.fd, header, kHeaderBytes, path);
  if (got < kHeaderBytes || std::memcmp(header, kMagic, sizeof kMagic) != 0)
    fail(path, "is not a gradagg checkpoint (no \"GRADAGG CKPT v1\" header)");
  std::uint64_t length = 0, crc = 0;
  std::memcpy(&length, header + 16, 8);
  std::memcpy(&crc, header + 24, 8);
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (length != size - kHeaderBytes)
    fail(path, fmt::format("is truncated or corrupt: the header says {} bytes of content, the "
                           "file has {}",
                           length, size - kHeaderBytes));
  // A header that agrees with a huge file is read only if the memory is there.
  std::string payload;
  try {
    payload.resize(static_cast<std::size_t>(length));
  } catch (const std::exception&) {  // std::bad_alloc, std::length_error
    fail(path, fmt::format("cannot be read: its {} bytes of content do not fit in this process's "
                           "memory",
                           length));
  }
  const std::size_t read = readUpTo(f.fd, payload.data(), payload.size(), path);
  if (read != length)  // it shrank while we read
    fail(path, fmt::format("is truncated or corrupt: the header says {} bytes of content, the "
                           "file has {}",
                           length, read));
  const std::uint64_t actual = crc64(payload.data(), length);
  if (actual != crc)
    fail(path, fmt::format("is corrupt: its content's CRC-64 is {:016x}, the header says {:016x}",
                           actual, crc));
  if (crc_out != nullptr) *crc_out = crc;
  return payload;
}

}  // namespace gradagg::detail
