// TempDir (src/runtime/temp_dir.h), which the tests and the bench put their files in:
// a fresh directory under $TMPDIR, removed with its contents by its one owner.
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include <gtest/gtest.h>

#include "runtime/temp_dir.h"
#include "support/expect_throws.h"

namespace gradagg::detail {
namespace {

namespace fs = std::filesystem;
using gradagg_test::expectThrows;

// Sets TMPDIR for a scope and puts the previous value back.
class ScopedTmpdir {
 public:
  explicit ScopedTmpdir(const std::string& value) {
    if (const char* old = std::getenv("TMPDIR")) saved_ = old;
    ::setenv("TMPDIR", value.c_str(), 1);
  }
  ~ScopedTmpdir() {
    if (saved_)
      ::setenv("TMPDIR", saved_->c_str(), 1);
    else
      ::unsetenv("TMPDIR");
  }

 private:
  std::optional<std::string> saved_;
};

TEST(TempDir, IsAFreshDirectoryUnderTmpdirRemovedWithEverythingInIt) {
  TempDir outer;
  ScopedTmpdir tmpdir(outer.path());
  std::string path;
  {
    TempDir dir("tag");
    TempDir other("tag");
    path = dir.path();
    EXPECT_EQ(path.rfind(outer.path() + "/gradagg-tag-", 0), 0u) << path;
    EXPECT_NE(path, other.path());
    ASSERT_TRUE(fs::is_directory(path));
    fs::create_directories(dir.file("a/b"));
    std::ofstream(dir.file("a/b/file")) << "data";
    ASSERT_TRUE(fs::exists(dir.file("a/b/file")));
  }
  EXPECT_FALSE(fs::exists(path)) << path << " outlived its TempDir";
  EXPECT_TRUE(fs::is_empty(outer.path()));
}

TEST(TempDir, WithoutTmpdirIsUnderTmp) {
  ScopedTmpdir tmpdir("");
  TempDir dir;
  EXPECT_EQ(dir.path().rfind("/tmp/gradagg-", 0), 0u) << dir.path();
}

TEST(TempDir, AMoveHandsTheDirectoryToTheNewOwner) {
  TempDir a;
  const std::string path = a.path();
  TempDir b(std::move(a));
  EXPECT_EQ(a.path(), "");  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(b.path(), path);
  { TempDir gone(std::move(a)); }  // an empty one removes nothing
  EXPECT_TRUE(fs::is_directory(path));
  TempDir c;
  const std::string replaced = c.path();
  c = std::move(b);  // c's own directory goes, b's is now c's
  EXPECT_FALSE(fs::exists(replaced));
  EXPECT_EQ(c.path(), path);
  EXPECT_TRUE(fs::is_directory(path));
}

TEST(TempDir, AForkedChildThatDestroysItLeavesTheDirectoryToItsCreator) {
  TempDir dir;
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    { TempDir in_child(std::move(dir)); }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_TRUE(fs::is_directory(dir.path())) << "a child removed its parent's directory";
}

TEST(TempDir, AMissingTmpdirIsASystemErrorWithErrno) {
  TempDir outer;
  ScopedTmpdir tmpdir(outer.file("absent"));
  if (const auto e = expectThrows<std::system_error>([] { TempDir dir; }, "mkdtemp")) {
    EXPECT_EQ(e->code(), std::errc::no_such_file_or_directory) << e->what();
  }
}

}  // namespace
}  // namespace gradagg::detail
