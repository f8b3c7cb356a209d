// Helpers shared by the Fashion-MNIST example's tests: files as bytes and the
// child-process check every multi-process test ends with (torch-free, unlike
// tests/support). Their files go in a gradagg::detail::TempDir (runtime/temp_dir.h).
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fashion_test {

// Child processes of this process, over all its threads (from /proc).
inline std::vector<pid_t> childPids() {
  std::vector<pid_t> pids;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream children(task.path() / "children");
    pid_t pid;
    while (children >> pid) pids.push_back(pid);
  }
  return pids;
}

inline std::vector<unsigned char> readBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void writeBytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

}  // namespace fashion_test
