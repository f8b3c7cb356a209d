// CheckpointLock: a second run writing a checkpoint path that a live run holds
// is refused when it starts, naming the holder's pid; the lock goes with its
// holder (destroyed, or killed with SIGKILL); a file that is not a lock file is
// never overwritten; dead writers' temporary files are still cleaned up.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <thread>

#include <gradagg/checkpoint.h>

#include "checkpoint/durable_file.h"
#include "runtime/temp_dir.h"
#include "support/expect_throws.h"

namespace gradagg_test {
namespace {

using gradagg::Checkpoint;
using gradagg::CheckpointError;
using gradagg::CheckpointLock;
using gradagg::detail::TempDir;

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A forked child, killed with SIGKILL and reaped when this goes out of scope.
class Child {
 public:
  explicit Child(const std::function<void(int out)>& body) {
    int fds[2];
    if (::pipe(fds) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(fds[0]);
      body(fds[1]);
      ::_exit(0);
    }
    ::close(fds[1]);
    out_ = fds[0];
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) ::close(out_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  // What the child wrote up to `until` (or its end), within 10 s.
  std::string read(char until = '\0') {
    std::string got;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    char c;
    while (std::chrono::steady_clock::now() < deadline) {
      const ssize_t n = ::read(out_, &c, 1);
      if (n <= 0 || (until != '\0' && c == until)) break;
      got += c;
    }
    return got;
  }
  void kill9() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
};

void say(int fd, const std::string& text) { (void)!::write(fd, text.data(), text.size()); }

// In a child: takes the lock of `path` (with a Checkpoint, the public way) and
// says "ok" or the error's message.
std::string tryInChild(const std::string& path) {
  Child child([&](int out) {
    try {
      const Checkpoint checkpoint(path);
      say(out, "ok");
    } catch (const std::exception& e) {
      say(out, e.what());
    }
  });
  return child.read();
}

class CheckpointLockTest : public ::testing::Test {
 protected:
  TempDir dir_{"ckptlock"};
  std::string path_ = dir_.file("run.ckpt");
};

TEST_F(CheckpointLockTest, ASecondWriterInAnotherProcessIsRefusedNamingTheHoldersPid) {
  const Checkpoint holder(path_);
  const std::string refused = tryInChild(path_);
  EXPECT_NE(refused.find(path_ + ": is being written by process " + std::to_string(::getpid()) +
                         " (its lock " + path_ + ".lock)"),
            std::string::npos)
      << refused;
  // A reader is not a writer: read-only access takes no lock.
  Child reader([&](int out) {
    const Checkpoint read_only(path_, Checkpoint::Access::kReadOnly);
    say(out, "ok");
  });
  EXPECT_EQ(reader.read(), "ok");
}

TEST_F(CheckpointLockTest, TheRefusalComesAsACheckpointErrorNamingTheCheckpoint) {
  const CheckpointLock holder(path_);
  Child child([&](int out) {
    try {
      CheckpointLock second(path_);
      say(out, "not refused");
    } catch (const CheckpointError& e) {
      say(out, e.path() == path_ ? "refused" : "names " + e.path());
    }
  });
  EXPECT_EQ(child.read(), "refused");
}

TEST_F(CheckpointLockTest, AfterTheHolderIsDestroyedANewHolderSucceeds) {
  {
    const Checkpoint holder(path_);
    EXPECT_TRUE(std::filesystem::exists(CheckpointLock::lockPathOf(path_)));
  }
  EXPECT_FALSE(std::filesystem::exists(CheckpointLock::lockPathOf(path_)))
      << "a clean release removes the lock file";
  EXPECT_EQ(tryInChild(path_), "ok");
  // Moved from: the lock goes with the object it was moved to.
  CheckpointLock moved = [&] {
    CheckpointLock first(path_);
    return CheckpointLock(std::move(first));
  }();
  EXPECT_NE(tryInChild(path_), "ok") << "the moved lock was released";
  moved = CheckpointLock(dir_.file("other.ckpt"));
  EXPECT_EQ(tryInChild(path_), "ok") << "assigning over a lock releases it";
}

TEST_F(CheckpointLockTest, AfterAHolderIsKilledWithSigkillANewHolderSucceeds) {
  // The holder forks a process of its own (as an Aggregator forks workers),
  // which outlives it: it must not keep the lock. The worker says its pid
  // itself, so it has run (and closed its copy) before the holder is killed.
  Child holder([&](int out) {
    const Checkpoint checkpoint(path_);
    if (::fork() == 0) {
      say(out, std::to_string(::getpid()) + "\n");
      ::sleep(30);
      ::_exit(0);
    }
    ::pause();
  });
  const pid_t worker = std::stoi("0" + holder.read('\n'));
  ASSERT_GT(worker, 0);
  struct KillWorker {
    pid_t pid;
    ~KillWorker() { ::kill(pid, SIGKILL); }
  } kill_worker{worker};
  expectThrows<CheckpointError>([&] { Checkpoint{path_}; },
                                "is being written by process " + std::to_string(holder.pid()));
  holder.kill9();
  ASSERT_TRUE(std::filesystem::exists(CheckpointLock::lockPathOf(path_)))
      << "a killed holder leaves its lock file";
  const Checkpoint next(path_);  // takes it over
  EXPECT_NE(readFile(CheckpointLock::lockPathOf(path_)).find("pid " + std::to_string(::getpid())),
            std::string::npos);
  EXPECT_NE(tryInChild(path_).find("process " + std::to_string(::getpid())), std::string::npos);
}

TEST_F(CheckpointLockTest, ALockADeadHoldersChildKeepsAMomentLongerIsTakenOnceItGoes) {
  // A holder killed right after a fork leaves its lock with the child until
  // the child first runs and closes its copy: an acquirer that finds a dead
  // holder named tries again for up to a second instead of refusing at once.
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  Child child([&](int out) {
    const int fd = ::open(CheckpointLock::lockPathOf(path_).c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0 || ::flock(fd, LOCK_EX | LOCK_NB) != 0) return say(out, "not locked\n");
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const std::string text =
        "gradagg checkpoint lock\npid " + std::to_string(dead) + "\nhost " + host + "\n";
    (void)!::write(fd, text.data(), text.size());
    say(out, "locked\n");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  });
  ASSERT_EQ(child.read('\n'), "locked");
  const Checkpoint next(path_);  // waits for the child to exit, then takes it over
  EXPECT_NE(readFile(CheckpointLock::lockPathOf(path_)).find("pid " + std::to_string(::getpid())),
            std::string::npos);
  // A live holder is still named at once.
  EXPECT_NE(tryInChild(path_).find("process " + std::to_string(::getpid())), std::string::npos);
}

TEST_F(CheckpointLockTest, CheckpointsOfOnePathInOneProcessShareTheLock) {
  auto first = std::make_unique<Checkpoint>(path_);
  const Checkpoint second(path_);  // not refused: the same process
  const Checkpoint copy = second;
  first.reset();
  EXPECT_NE(tryInChild(path_), "ok") << "released while the other Checkpoint lives";
}

TEST_F(CheckpointLockTest, AFileAtTheLockPathThatIsNotALockFileIsNeverOverwritten) {
  gradagg::detail::writeDurably(CheckpointLock::lockPathOf(path_), "another checkpoint");
  const std::string before = readFile(CheckpointLock::lockPathOf(path_));
  expectThrows<CheckpointError>([&] { Checkpoint{path_}; }, "is not a gradagg lock file");
  EXPECT_EQ(readFile(CheckpointLock::lockPathOf(path_)), before);
}

TEST_F(CheckpointLockTest, TheLockFileIsNoCheckpointAndOrphanCleanupStillWorks) {
  const Checkpoint holder(path_);
  const std::string lock = CheckpointLock::lockPathOf(path_);
  EXPECT_EQ(std::filesystem::status(lock).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  expectThrows<CheckpointError>([&] { gradagg::detail::readVerified(lock); },
                                "is not a gradagg checkpoint");
  // A dead writer's old temporary file goes at the next save; the lock stays.
  const pid_t dead = [] {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(0);
    ::waitpid(pid, nullptr, 0);
    return pid;
  }();
  const std::string orphan = path_ + ".tmp-" + std::to_string(dead);
  std::ofstream(orphan) << "partial";
  const std::time_t old = std::time(nullptr) - 3600;
  struct timespec times[2] = {{old, 0}, {old, 0}};
  ::utimensat(AT_FDCWD, orphan.c_str(), times, 0);
  gradagg::detail::writeDurably(path_, "payload");
  EXPECT_FALSE(std::filesystem::exists(orphan));
  EXPECT_TRUE(std::filesystem::exists(lock));
  EXPECT_EQ(gradagg::detail::readVerified(path_), "payload");
}

}  // namespace
}  // namespace gradagg_test
