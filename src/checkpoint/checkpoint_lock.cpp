// CheckpointLock (include/gradagg/checkpoint.h): flock(LOCK_EX | LOCK_NB) on
// "<path>.lock". The file holds
//
//   gradagg checkpoint lock\n
//   pid <pid>\n
//   host <hostname>\n
//
// written by the holder once it has the lock; a refused acquirer reads it to
// name the holder. The holder removes the file when it releases (before it
// closes, still holding the lock), so an acquirer that locked a file it opened
// just before that checks, once locked, that the path still names that file,
// and tries again with the new one when it does not.
//
// In one process, locks of one file share its descriptor (a count per file,
// under a mutex): flock locks belong to the open file, so a second open of it
// in the same process would be refused. A forked child (a worker) closes its
// copies of the descriptors at once (pthread_atfork), so that it never keeps a
// lock alive after its parent is gone; it ignores the entries it inherits
// (they are its parent's) and releases none. Until the child first runs it
// shares the lock, so an acquirer refused by a holder that is dead (on this
// host) tries again for up to a second before it names it.
#include <gradagg/checkpoint.h>

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include <fmt/format.h>

namespace gradagg {

namespace {

constexpr const char* kLockMagic = "gradagg checkpoint lock\n";

struct Held {
  dev_t dev = 0;
  ino_t ino = 0;
  int fd = -1;
  int refs = 0;
  pid_t owner = 0;
  std::string lock_path;
};

std::mutex g_mutex;
std::map<std::uint64_t, Held> g_held;  // under g_mutex
std::uint64_t g_next_key = 1;          // under g_mutex

// Around fork(): the mutex is held across it, and the child closes the
// descriptors (the parent keeps the locks).
void installForkHandlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    ::pthread_atfork([] { g_mutex.lock(); }, [] { g_mutex.unlock(); },
                     [] {
                       for (auto& entry : g_held) {
                         if (entry.second.fd >= 0) ::close(entry.second.fd);
                         entry.second.fd = -1;
                       }
                       g_mutex.unlock();
                     });
  });
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw CheckpointError(fmt::format("gradagg: checkpoint {}: {}", path, what), path);
}

std::string hostName() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "";
  return host;
}

std::string readAll(int fd) {
  std::string out;
  char buf[512];
  for (off_t at = 0;;) {
    const ssize_t n = ::pread(fd, buf, sizeof buf, at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || out.size() > 4096) return out;
    out.append(buf, static_cast<std::size_t>(n));
    at += n;
  }
}

// The value of "<key> <value>\n" in a lock file's text, or "".
std::string field(const std::string& text, const std::string& key) {
  const std::string start = "\n" + key + " ";
  const auto at = text.find(start);
  if (at == std::string::npos) return "";
  const auto end = text.find('\n', at + start.size());
  if (end == std::string::npos) return "";
  return text.substr(at + start.size(), end - at - start.size());
}

// Who holds the lock on `fd`'s file, from its text: "process 1234" (" on host
// h" when not this host), or "" when the text names no live holder: it may be
// a holder's that has just locked and not yet written its pid, or a killed
// holder's whose forked child has not yet closed its copy of the descriptor
// (the child closes it at once, but only once it first runs).
std::string liveHolderOf(int fd) {
  const std::string here = hostName();
  const std::string text = readAll(fd);
  const std::string pid = field(text, "pid"), host = field(text, "host");
  const bool parsed =
      !pid.empty() && pid.size() <= 9 && pid.find_first_not_of("0123456789") == std::string::npos;
  if (!parsed) return "";
  if (!host.empty() && host != here) return fmt::format("process {} on host {}", pid, host);
  if (::kill(std::stoi(pid), 0) == 0 || errno != ESRCH) return fmt::format("process {}", pid);
  return "";
}

// flock(LOCK_EX | LOCK_NB) on `fd`; while it is refused and no live holder is
// named, tries again every 10 ms for up to a second. 0, or the errno of the
// refusal with `holder` set to whom it names ("another process" when none).
int lockOrName(int fd, std::string& holder) {
  for (int attempt = 0;; ++attempt) {
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return 0;
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EWOULDBLOCK) return err;
    holder = liveHolderOf(fd);
    if (!holder.empty()) return err;
    if (attempt == 100) {
      const std::string pid = field(readAll(fd), "pid");
      holder = pid.empty() ? "another process" : fmt::format("process {}", pid);
      return err;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool noLocksHere(int err) { return err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS; }

}  // namespace

std::string CheckpointLock::lockPathOf(const std::string& checkpoint_path) {
  return checkpoint_path + ".lock";
}

CheckpointLock::CheckpointLock(const std::string& checkpoint_path) {
  const std::string lock_path = lockPathOf(checkpoint_path);
  const pid_t self = ::getpid();
  installForkHandlers();
  std::lock_guard<std::mutex> guard(g_mutex);
  for (int attempt = 0; attempt < 20; ++attempt) {
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    struct stat st {};
    if (fd < 0 || ::fstat(fd, &st) != 0) {
      const int err = errno;
      if (fd >= 0) ::close(fd);
      fail(checkpoint_path,
           fmt::format("its lock {} cannot be opened: {}", lock_path, std::strerror(err)));
    }
    // This process holds it already: share it.
    for (auto& [key, held] : g_held) {
      if (held.owner == self && held.dev == st.st_dev && held.ino == st.st_ino) {
        ::close(fd);
        ++held.refs;
        key_ = key;
        owner_ = self;
        return;
      }
    }
    std::string holder;
    if (const int err = lockOrName(fd, holder); err != 0) {
      if (noLocksHere(err)) {  // this file system has no locks: nothing is held
        ::close(fd);
        return;
      }
      ::close(fd);
      if (err != EWOULDBLOCK)
        fail(checkpoint_path, fmt::format("locking {} failed: {}", lock_path, std::strerror(err)));
      fail(checkpoint_path,
           fmt::format("is being written by {} (its lock {}); wait for it to end or write "
                       "another path",
                       holder, lock_path));
    }
    // Locked. Still the file at lock_path? (A holder that released removed it.)
    struct stat now {};
    if (::stat(lock_path.c_str(), &now) != 0 || now.st_dev != st.st_dev ||
        now.st_ino != st.st_ino) {
      ::close(fd);
      continue;
    }
    // Never overwrite what is not a lock file (a checkpoint named "<path>.lock").
    const std::string text = readAll(fd);
    if (!text.empty() && text.compare(0, std::strlen(kLockMagic), kLockMagic) != 0) {
      ::close(fd);
      fail(checkpoint_path, fmt::format("its lock {} exists and is not a gradagg lock file (it "
                                        "is left as it is): move it away or write another path",
                                        lock_path));
    }
    const std::string mine = fmt::format("{}pid {}\nhost {}\n", kLockMagic, self, hostName());
    if (::ftruncate(fd, 0) != 0 ||
        ::pwrite(fd, mine.data(), mine.size(), 0) != static_cast<ssize_t>(mine.size())) {
      const int err = errno;
      ::unlink(lock_path.c_str());
      ::close(fd);
      fail(checkpoint_path,
           fmt::format("writing its lock {} failed: {}", lock_path, std::strerror(err)));
    }
    key_ = g_next_key++;
    owner_ = self;
    g_held[key_] = Held{st.st_dev, st.st_ino, fd, 1, self, lock_path};
    return;
  }
  fail(checkpoint_path, fmt::format("its lock {} kept being replaced", lock_path));
}

CheckpointLock::CheckpointLock(CheckpointLock&& other) noexcept
    : key_(std::exchange(other.key_, 0)), owner_(std::exchange(other.owner_, 0)) {}

CheckpointLock& CheckpointLock::operator=(CheckpointLock&& other) noexcept {
  if (this != &other) {
    release();
    key_ = std::exchange(other.key_, 0);
    owner_ = std::exchange(other.owner_, 0);
  }
  return *this;
}

CheckpointLock::~CheckpointLock() { release(); }

void CheckpointLock::release() noexcept {
  if (key_ == 0 || owner_ != ::getpid()) return;  // nothing, or a forked copy: the parent's
  std::lock_guard<std::mutex> guard(g_mutex);
  const auto it = g_held.find(std::exchange(key_, 0));
  if (it == g_held.end() || --it->second.refs > 0) return;
  const Held& held = it->second;
  // Removed while still locked, and only when the path is still our file.
  struct stat st {};
  if (::stat(held.lock_path.c_str(), &st) == 0 && st.st_dev == held.dev && st.st_ino == held.ino)
    ::unlink(held.lock_path.c_str());
  ::close(held.fd);
  g_held.erase(it);
}

namespace detail {
bool holdsCheckpointLock(const std::string& checkpoint_path) {
  const std::string lock_path = CheckpointLock::lockPathOf(checkpoint_path);
  struct stat st {};
  if (::stat(lock_path.c_str(), &st) != 0) return false;
  const pid_t self = ::getpid();
  std::lock_guard<std::mutex> guard(g_mutex);
  for (const auto& [key, held] : g_held)
    if (held.owner == self && held.dev == st.st_dev && held.ino == st.st_ino) return true;
  return false;
}
}  // namespace detail

}  // namespace gradagg
