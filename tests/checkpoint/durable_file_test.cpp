// The envelope's edges (checkpoint/durable_file.h), torch-free: a huge file
// that is not a checkpoint is refused from its header without being read, and
// temporary files left by writers killed mid-save are removed once their
// process is gone and they are old, never a live writer's.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <gradagg/checkpoint.h>

#include "checkpoint/durable_file.h"
#include "runtime/temp_dir.h"
#include "support/expect_throws.h"

namespace gradagg_test {
namespace {

using gradagg::detail::TempDir;

void touch(const std::string& path, std::time_t mtime) {
  std::ofstream(path) << "partial";
  struct timespec times[2] = {{mtime, 0}, {mtime, 0}};
  ::utimensat(AT_FDCWD, path.c_str(), times, 0);
}

// A process id that was in use a moment ago and is no more.
pid_t deadPid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

TEST(DurableFile, AHugeFileIsRefusedFromItsHeaderWithoutBeingRead) {
  TempDir dir("durable");
  const std::string path = dir.file("huge.ckpt");
  {
    std::ofstream out(path);
    out << "GRADAGG CKPT v1\n" << std::string(16, '\x01');  // claims 0x0101... bytes
  }
  ASSERT_EQ(::truncate(path.c_str(), 64ll << 30), 0);  // 64 GiB, sparse
  expectThrows<gradagg::CheckpointError>([&] { gradagg::detail::readVerified(path); },
                                         "is truncated or corrupt");
  const std::string other = dir.file("not-a-checkpoint");
  std::ofstream(other) << "hello";
  ASSERT_EQ(::truncate(other.c_str(), 64ll << 30), 0);
  expectThrows<gradagg::CheckpointError>([&] { gradagg::detail::readVerified(other); },
                                         "is not a gradagg checkpoint");
}

TEST(DurableFile, OldTemporaryFilesOfDeadWritersAreRemovedOthersKept) {
  TempDir dir("durable");
  const std::string path = dir.file("run.ckpt");
  const std::time_t now = std::time(nullptr), old = now - 3600;
  const std::string dead_old = path + ".tmp-" + std::to_string(deadPid());
  const std::string dead_new = path + ".tmp-" + std::to_string(deadPid());
  const std::string alive_old = path + ".tmp-" + std::to_string(::getppid());
  const std::string other_file = dir.file("other.ckpt.tmp-1");
  touch(dead_old, old);
  touch(dead_new, now);
  touch(alive_old, old);
  touch(other_file, old);
  gradagg::detail::writeDurably(path, "payload");
  EXPECT_FALSE(std::filesystem::exists(dead_old)) << "a dead writer's old file stayed";
  EXPECT_TRUE(std::filesystem::exists(dead_new))
      << "a fresh file is kept (may be a writer elsewhere)";
  EXPECT_TRUE(std::filesystem::exists(alive_old)) << "a live process's file was removed";
  EXPECT_TRUE(std::filesystem::exists(other_file)) << "another checkpoint's file was removed";
  EXPECT_EQ(gradagg::detail::readVerified(path), "payload");
}

// Under the path's lock no other run writes it: a dead writer's file goes at
// the next save however fresh; a live process's stays.
TEST(DurableFile, UnderTheLockADeadWritersFreshTemporaryFileGoesAtOnce) {
  TempDir dir("durable");
  const std::string path = dir.file("run.ckpt");
  const std::time_t now = std::time(nullptr);
  const std::string dead_new = path + ".tmp-" + std::to_string(deadPid());
  const std::string alive_new = path + ".tmp-" + std::to_string(::getppid());
  touch(dead_new, now);
  touch(alive_new, now);
  {
    gradagg::CheckpointLock lock(path);
    EXPECT_TRUE(gradagg::detail::holdsCheckpointLock(path));
    gradagg::detail::writeDurably(path, "payload");
  }
  EXPECT_FALSE(gradagg::detail::holdsCheckpointLock(path));
  EXPECT_FALSE(std::filesystem::exists(dead_new)) << "a dead writer's fresh file stayed";
  EXPECT_TRUE(std::filesystem::exists(alive_new)) << "a live process's file was removed";
  EXPECT_EQ(gradagg::detail::readVerified(path), "payload");
}

// Two threads of one process saving the same path at once (a periodic save in
// the background and the final one): every save leaves one writer's whole file,
// never a mix of both, and no temporary file stays.
TEST(DurableFile, TwoThreadsSavingOnePathAtOnceEachLeaveAWholeFile) {
  TempDir dir("durable");
  const std::string path = dir.file("run.ckpt");
  const std::string a(3 << 20, 'a'), b(2 << 20, 'b');  // different sizes and bytes
  for (int round = 0; round < 20; ++round) {
    std::string failed;  // the other thread's error, if any
    std::thread other([&] {
      try {
        gradagg::detail::writeDurably(path, b);
      } catch (const std::exception& e) {
        failed = e.what();
      }
    });
    EXPECT_NO_THROW(gradagg::detail::writeDurably(path, a)) << "round " << round;
    other.join();
    ASSERT_EQ(failed, "") << "round " << round;
    const std::string got = gradagg::detail::readVerified(path);
    ASSERT_TRUE(got == a || got == b) << "round " << round << ": " << got.size() << " bytes";
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos) << entry.path();
}

// A dead writer's file of the per-write form "<path>.tmp-<pid>.<n>" is an orphan too.
TEST(DurableFile, ADeadWritersNumberedTemporaryFileGoesToo) {
  TempDir dir("durable");
  const std::string path = dir.file("run.ckpt");
  const std::string dead = path + ".tmp-" + std::to_string(deadPid()) + ".7";
  const std::string not_ours = path + ".tmp-" + std::to_string(deadPid()) + ".x";
  touch(dead, std::time(nullptr) - 3600);
  touch(not_ours, std::time(nullptr) - 3600);
  gradagg::detail::writeDurably(path, "payload");
  EXPECT_FALSE(std::filesystem::exists(dead)) << "a dead writer's numbered file stayed";
  EXPECT_TRUE(std::filesystem::exists(not_ours)) << "a file not of our form was removed";
}

}  // namespace
}  // namespace gradagg_test
