#include "forked_peers.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

namespace gradagg::bench {

SharedMapping::SharedMapping(std::size_t bytes) : size_(bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap");
  data_ = p;
}

SharedMapping::~SharedMapping() {
  if (data_) ::munmap(data_, size_);
}

SharedMapping::SharedMapping(SharedMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

SharedMapping& SharedMapping::operator=(SharedMapping&& other) noexcept {
  if (this != &other) {
    if (data_) ::munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

ForkedPeers::~ForkedPeers() { killAll(); }

void ForkedPeers::spawn(int n, const std::function<int(int rank)>& body) {
  const pid_t parent = ::getpid();
  std::fflush(nullptr);  // nothing buffered is written twice
  for (int rank = 0; rank < n; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      killAll();
      throw std::system_error(err, std::generic_category(), "fork");
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(4);
      int status = 1;
      std::thread([&] {
        try {
          status = body(rank);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "gradagg-bench: peer %d failed: %s\n", rank, e.what());
        } catch (...) {
          std::fprintf(stderr, "gradagg-bench: peer %d failed with an unknown exception\n", rank);
        }
      }).join();
      std::fflush(nullptr);
      ::_exit(status);
    }
    pids_.push_back(pid);
  }
}

void ForkedPeers::join(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    bool running = false;
    for (std::size_t rank = 0; rank < pids_.size(); ++rank) {
      if (pids_[rank] < 0) continue;
      int status = 0;
      const pid_t got = ::waitpid(pids_[rank], &status, WNOHANG);
      if (got == 0) {
        running = true;
        continue;
      }
      pids_[rank] = -1;
      if (got < 0) throw std::system_error(errno, std::generic_category(), "waitpid");
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      killAll();
      throw std::runtime_error(
          "gradagg-bench: peer " + std::to_string(rank) +
          (WIFEXITED(status) ? " exited with status " + std::to_string(WEXITSTATUS(status))
                             : std::string(" was killed by signal ") + strsignal(WTERMSIG(status))));
    }
    if (!running) {
      pids_.clear();
      return;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      killAll();
      throw std::runtime_error("gradagg-bench: peers still running after " +
                               std::to_string(timeout.count()) + " ms; killed");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

void ForkedPeers::killAll() noexcept {
  for (pid_t pid : pids_)
    if (pid > 0) ::kill(pid, SIGKILL);
  for (pid_t pid : pids_)
    if (pid > 0) ::waitpid(pid, nullptr, 0);
  pids_.clear();
}

}  // namespace gradagg::bench
