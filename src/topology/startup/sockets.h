// Sockets: the descriptors (and inodes) of this process's sockets, so that the
// connections a start-up opened can be told from the rest: gloo keeps its
// sockets private, and InterruptWatch (topology/group/) shuts those down.
#pragma once

#include <sys/types.h>

#include <utility>
#include <vector>

namespace gradagg::detail {

struct Sockets {
  std::vector<std::pair<int, ino_t>> open;  // descriptor, inode
  // This process's sockets now.
  static Sockets now();
  // Those in `later` that are not in `earlier`.
  static Sockets since(const Sockets& earlier, const Sockets& later);
};

}  // namespace gradagg::detail
