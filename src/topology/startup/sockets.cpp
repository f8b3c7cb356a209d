#include "topology/startup/sockets.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>

namespace gradagg::detail {

Sockets Sockets::now() {
  Sockets s;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return s;
  const int own = ::dirfd(dir);
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const int fd = std::atoi(e->d_name);
    struct stat st {};
    if (fd == own || ::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    s.open.emplace_back(fd, st.st_ino);
  }
  ::closedir(dir);
  return s;
}

Sockets Sockets::since(const Sockets& earlier, const Sockets& later) {
  Sockets s;
  for (const auto& fd : later.open)
    if (std::find(earlier.open.begin(), earlier.open.end(), fd) == earlier.open.end())
      s.open.push_back(fd);
  return s;
}

}  // namespace gradagg::detail
