#include "topology/startup/store_server.h"

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstring>
#include <list>
#include <map>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "topology/startup/store_wire.h"

namespace gradagg::detail {

namespace {
volatile std::sig_atomic_t g_stop = 0;  // the child's: SIGTERM came
void onTerm(int) { g_stop = 1; }

using Clock = std::chrono::steady_clock;

// A listening socket on `port` of every interface: IPv6 taking IPv4 too, or
// IPv4 alone where there is no IPv6. Throws std::runtime_error.
int listenOn(int port) {
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  const int on = 1, off = 0;
  int r = -1;
  if (fd >= 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<std::uint16_t>(port));
    r = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    if (r != 0 && errno != EAFNOSUPPORT && errno != EADDRNOTAVAIL) {
      const int e = errno;
      ::close(fd);
      throw std::runtime_error(
          fmt::format("the store cannot listen on port {}: {}", port, std::strerror(e)));
    }
  }
  if (r != 0) {  // no IPv6 here
    if (fd >= 0) ::close(fd);
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error(fmt::format("socket: {}", std::strerror(errno)));
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    r = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  if (r != 0 || ::listen(fd, 128) != 0) {
    const int e = errno;
    ::close(fd);
    throw std::runtime_error(
        fmt::format("the store cannot listen on port {}: {}", port, std::strerror(e)));
  }
  return fd;
}

// One client's connection: what it sent that is not a whole frame yet, and
// the replies it has not taken yet.
struct Connection {
  int fd = -1;
  std::string in, out;
  std::size_t sent = 0;      // of `out`
  bool greeted = false;      // its first frame was a kHello with the magic
  Clock::time_point opened;  // its connect
  Clock::time_point since;   // its connect, then its last progress either way
  bool stalled(Clock::time_point now) const {
    if (!greeted && now - opened > StoreServer::kStallLimit) return true;
    const bool owes = !in.empty() || sent < out.size();
    return owes && now - since > StoreServer::kStallLimit;
  }
};

// The keys, and the rules of each request. A request it cannot parse is the
// end of its connection (serve() closes it): handle() returns false.
class Keys {
 public:
  bool handle(Connection& c, const std::string& body) {
    wire::Reader in(body);
    const auto op = in.byte();
    wire::Writer reply;
    reply.byte(wire::kOk);
    if (!c.greeted) {
      if (op != wire::kHello || in.field() != wire::kMagic || !in.done()) return false;
      c.greeted = true;
    } else if (op == wire::kSet) {
      std::string key = in.field(), value = in.field();
      if (!in.done()) return false;
      if (!put(key, std::move(value))) reply = refused("the store is full");
    } else if (op == wire::kCompareSet) {
      std::string key = in.field(), expected = in.field(), desired = in.field();
      if (!in.done()) return false;
      // c10d's rule: a missing key is set when `expected` is empty, else
      // `expected` is answered; a present one is set when it equals `expected`;
      // the answer is the value now.
      const auto it = keys_.find(key);
      if (it == keys_.end()) {
        if (!expected.empty())
          reply.field(expected);
        else if (put(key, desired))
          reply.field(desired);
        else
          reply = refused("the store is full");
      } else {
        if (it->second == expected && !put(key, desired)) reply = refused("the store is full");
        reply.field(keys_[key]);
      }
    } else if (op == wire::kGet) {
      const std::string key = in.field();
      if (!in.done()) return false;
      const auto it = keys_.find(key);
      if (it == keys_.end())
        reply = refused("no such key");
      else
        reply.field(it->second);
    } else if (op == wire::kAdd) {
      const std::string key = in.field();
      const std::int64_t n = in.number();
      if (!in.done()) return false;
      std::int64_t was = 0;
      const auto it = keys_.find(key);
      if (it != keys_.end()) {
        const char* end = it->second.data() + it->second.size();
        const auto [p, e] = std::from_chars(it->second.data(), end, was);
        if (e != std::errc() || p != end) {
          c.out += refused("the key's value is not a number").frame();
          return true;
        }
      }
      const std::int64_t sum = static_cast<std::int64_t>(static_cast<std::uint64_t>(was) +
                                                         static_cast<std::uint64_t>(n));
      if (put(key, std::to_string(sum)))
        reply.number(sum);
      else
        reply = refused("the store is full");
    } else if (op == wire::kDelete) {
      const std::string key = in.field();
      if (!in.done()) return false;
      const auto it = keys_.find(key);
      reply.byte(it != keys_.end() ? 1 : 0);
      if (it != keys_.end()) {
        bytes_ -= it->first.size() + it->second.size();
        keys_.erase(it);
      }
    } else if (op == wire::kCheck) {
      const std::int64_t n = in.number();
      bool all = true;
      for (std::int64_t i = 0; i < n && in.ok(); ++i) all = keys_.count(in.field()) > 0 && all;
      if (n < 0 || !in.done()) return false;
      reply.byte(all ? 1 : 0);
    } else if (op == wire::kNumKeys) {
      if (!in.done()) return false;
      reply.number(static_cast<std::int64_t>(keys_.size()));
    } else {
      return false;
    }
    c.out += reply.frame();
    return true;
  }

 private:
  static wire::Writer refused(const std::string& why) {
    wire::Writer w;
    w.byte(wire::kRefused).field(why);
    return w;
  }
  // Sets key to value unless the store would outgrow kMaxStoreBytes.
  bool put(const std::string& key, std::string value) {
    const auto it = keys_.find(key);
    const std::size_t was = it == keys_.end() ? 0 : key.size() + it->second.size();
    if (bytes_ - was + key.size() + value.size() > StoreServer::kMaxStoreBytes) return false;
    bytes_ = bytes_ - was + key.size() + value.size();
    keys_[key] = std::move(value);
    return true;
  }
  std::map<std::string, std::string> keys_;
  std::size_t bytes_ = 0;
};

// Reads what `c` sent and answers every whole frame; false: close it (gone,
// or it sent garbage).
bool readFrom(Connection& c, Keys& keys) {
  char buf[64 * 1024];
  for (;;) {
    const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n == 0) return false;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    c.in.append(buf, static_cast<std::size_t>(n));
    c.since = Clock::now();
    std::size_t at = 0;
    while (c.in.size() - at >= 4) {
      const auto length = static_cast<std::size_t>(wire::readLE(c.in.data() + at, 4));
      if (length == 0 || length > wire::kMaxFrame) return false;
      if (c.in.size() - at - 4 < length) break;
      if (!keys.handle(c, c.in.substr(at + 4, length))) return false;
      at += 4 + length;
    }
    c.in.erase(0, at);
    if (c.sent < c.out.size()) return true;  // its replies first: poll() waits for POLLOUT
  }
}

// Sends what `c` has not taken yet; false: close it.
bool writeTo(Connection& c) {
  while (c.sent < c.out.size()) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    c.sent += static_cast<std::size_t>(n);
    c.since = Clock::now();
  }
  c.out.clear();
  c.sent = 0;
  return true;
}

// The child: listen, report "ok" (or why not) on `report`, serve until
// SIGTERM or until the parent is gone. It never returns.
[[noreturn]] void serve(int port, int report, pid_t parent) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  ::signal(SIGTERM, onTerm);
  ::signal(SIGPIPE, SIG_IGN);
  std::string said = "ok";
  int listener = -1;
  try {
    listener = listenOn(port);
  } catch (const std::exception& e) {
    said = e.what();
  }
  (void)!::write(report, said.data(), said.size());
  ::close(report);
  if (listener < 0) ::_exit(1);
  Keys keys;
  std::list<Connection> connections;
  std::vector<pollfd> polled;
  while (::getppid() == parent && !g_stop) {
    polled.assign(1, pollfd{listener, POLLIN, 0});
    for (const Connection& c : connections)
      polled.push_back({c.fd, static_cast<short>(c.sent < c.out.size() ? POLLOUT : POLLIN), 0});
    if (::poll(polled.data(), polled.size(), 50) < 0 && errno != EINTR) ::_exit(2);
    const auto now = Clock::now();
    auto p = polled.begin() + 1;
    for (auto c = connections.begin(); c != connections.end(); ++p) {
      bool keep = !c->stalled(now);
      if (keep && (p->revents & POLLOUT)) keep = writeTo(*c);
      if (keep && (p->revents & (POLLIN | POLLHUP | POLLERR))) keep = readFrom(*c, keys);
      if (keep && c->sent < c->out.size()) keep = writeTo(*c);
      if (keep) {
        ++c;
      } else {
        ::close(c->fd);
        c = connections.erase(c);
      }
    }
    if (polled[0].revents & POLLIN) {
      for (;;) {
        const int fd = ::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        if (static_cast<int>(connections.size()) >= StoreServer::kMaxConnections) {
          ::close(fd);
          continue;
        }
        Connection c;
        c.fd = fd;
        c.opened = c.since = now;
        connections.push_back(std::move(c));
      }
    }
  }
  ::_exit(0);
}
}  // namespace

StoreServer::StoreServer(int port, const Deadline& deadline) {
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
    serve(port, fds[1], parent);
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
    ::kill(pid_, SIGKILL);  // nothing to finish: its clients see the connection end
    while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
  pid_ = -1;
}

}  // namespace gradagg::detail
