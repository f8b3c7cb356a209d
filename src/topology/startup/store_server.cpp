#include "topology/startup/store_server.h"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <stdexcept>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace gradagg::detail {

namespace {
volatile std::sig_atomic_t g_stop = 0;  // the child's: SIGTERM came
void onTerm(int) { g_stop = 1; }

// The child's last act: read what every client sent and nobody read (a
// stalled server has some), then close. A socket closed with unread bytes
// resets the connection, and c10d 1.13's TCPStore client dies of a reset in
// its background thread (std::terminate); an orderly close it survives.
void drainSockets() {
  for (int fd = 3; fd < 4096; ++fd) {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    char buf[4096];
    while (::recv(fd, buf, sizeof(buf), 0) > 0) {
    }
    ::shutdown(fd, SHUT_RDWR);
  }
}

// The child: serve, report "ok" (or why not) on `report`, then live until
// killed or until the parent is gone. It never returns.
[[noreturn]] void serve(const std::string& addr, int port, int nodes, int report, pid_t parent) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  ::signal(SIGTERM, onTerm);
  std::string said = "ok";
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    c10d::TCPStoreOptions t;
    t.port = static_cast<std::uint16_t>(port);
    t.isServer = true;
    t.numWorkers = nodes;
    t.waitWorkers = false;
    store = c10::make_intrusive<c10d::TCPStore>(addr, t);
  } catch (const c10::Error& e) {
    said = e.what_without_backtrace();
  } catch (const std::exception& e) {
    said = e.what();
  }
  (void)!::write(report, said.data(), said.size());
  ::close(report);
  if (said != "ok") ::_exit(1);
  while (::getppid() == parent && !g_stop) ::usleep(5 * 1000);
  const int null = ::open("/dev/null", O_WRONLY);  // c10d's thread may complain as it ends
  if (null >= 0) ::dup2(null, 2);
  drainSockets();
  ::_exit(0);
}
}  // namespace

StoreServer::StoreServer(const std::string& addr, int port, int nodes, const Deadline& deadline) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw std::runtime_error(fmt::format("pipe: {}", std::strerror(errno)));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw std::runtime_error(fmt::format("fork of the store server: {}", std::strerror(errno)));
  }
  if (pid == 0) {
    ::close(fds[0]);
    serve(addr, port, nodes, fds[1], parent);
  }
  pid_ = pid;
  owner_ = parent;
  ::close(fds[1]);
  std::string said;
  char buf[512];
  for (;;) {
    pollfd p{fds[0], POLLIN, 0};
    const int r = ::poll(&p, 1, 20);
    if (r > 0) {
      const ssize_t n = ::read(fds[0], buf, sizeof(buf));
      if (n > 0) said.append(buf, static_cast<std::size_t>(n));
      if (n == 0 || (n < 0 && errno != EINTR)) break;  // the child closed its end
      continue;
    }
    try {
      throwIfStopped(deadline, "the store server to listen");
    } catch (...) {
      ::close(fds[0]);
      stop();
      throw;
    }
  }
  ::close(fds[0]);
  if (said != "ok") {
    stop();
    throw std::runtime_error(said.empty() ? "the store server died while starting" : said);
  }
}

void StoreServer::stop() noexcept {
  if (pid_ <= 0) return;
  if (::getpid() == owner_) {
    ::kill(pid_, SIGTERM);  // drains and exits; killed if it does not within 500 ms
    for (int i = 0; i < 100; ++i) {
      const pid_t r = ::waitpid(pid_, nullptr, WNOHANG);
      if (r == pid_ || (r < 0 && errno != EINTR)) {
        pid_ = -1;
        return;
      }
      ::usleep(5 * 1000);
    }
    ::kill(pid_, SIGKILL);
    while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
  pid_ = -1;
}

}  // namespace gradagg::detail
