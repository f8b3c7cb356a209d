#include "runtime/quiet_fork.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace gradagg::detail {

namespace {
// The state letter of /proc/self/task/<tid>/stat: the field after the
// command, which is in parentheses and may itself hold ')'.
char stateOf(int task_dir, const char* tid) {
  char path[64];
  std::snprintf(path, sizeof path, "%s/stat", tid);
  const int fd = ::openat(task_dir, path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return '?';  // gone since the listing
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return '?';
  buf[n] = '\0';
  const char* close_paren = std::strrchr(buf, ')');
  return close_paren != nullptr && close_paren[1] == ' ' ? close_paren[2] : '?';
}
}  // namespace

int runnableOtherThreads() {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return 0;
  const long self = ::syscall(SYS_gettid);
  int runnable = 0;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    if (std::strtol(e->d_name, nullptr, 10) == self) continue;
    if (stateOf(::dirfd(dir), e->d_name) == 'R') ++runnable;
  }
  ::closedir(dir);
  return runnable;
}

bool settleOtherThreads(std::chrono::microseconds most) {
  const auto until = std::chrono::steady_clock::now() + most;
  for (;;) {
    if (runnableOtherThreads() == 0) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace gradagg::detail
