#include "topology/startup/store_client.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "runtime/interrupt.h"
#include "topology/startup/store_wire.h"

namespace gradagg::detail {

namespace {
constexpr std::chrono::milliseconds kSlice{20};  // the longest poll between looks at the clock

// Waits until `fd` is ready for `events` (or in error, which the next send or
// recv reports). Throws at `until` or on interruptWaits().
void await(int fd, short events, const Deadline& until, const std::string& what) {
  for (;;) {
    throwIfStopped(until, what);
    pollfd p{fd, events, 0};
    const auto ms = std::min(kSlice, until.left()).count();
    const int r = ::poll(&p, 1, static_cast<int>(ms));
    if (r > 0) return;
    if (r < 0 && errno != EINTR)
      throw std::runtime_error(fmt::format("poll: {}", std::strerror(errno)));
  }
}

// A connected socket to one of addr:port's addresses, or -1 and `why`.
int connectOnce(const std::string& addr, int port, const Deadline& deadline, std::string& why) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int r = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (r != 0) {
    why = ::gai_strerror(r);
    return -1;
  }
  int fd = -1;
  for (const addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int error = 0;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      error = errno;
      if (error == EINPROGRESS) {
        // At most a second on one address, then the next attempt.
        const Deadline attempt{std::min(deadline.at, SteadyClock::now() + std::chrono::seconds(1))};
        try {
          await(fd, POLLOUT, attempt, "a connection");
          socklen_t len = sizeof error;
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
        } catch (...) {
          if (interruptDue()) {
            ::close(fd);
            ::freeaddrinfo(found);
            throw;
          }
          error = ETIMEDOUT;
        }
      }
    }
    if (error != 0) {
      why = std::strerror(error);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  return fd;
}
}  // namespace

StoreClient::StoreClient(const std::string& addr, int port, Deadline deadline)
    : where_(fmt::format("{}:{}", addr, port)), deadline_(deadline) {
  std::string why = "nothing listens";
  for (;;) {
    if (interruptDue())
      throw std::runtime_error(
          fmt::format("interrupted while waiting for the store at {}", where_));
    fd_ = connectOnce(addr, port, deadline, why);
    if (fd_ >= 0) break;
    if (deadline.left() < std::chrono::milliseconds(50))
      throw std::runtime_error(fmt::format(
          "no store answered at {} (node 0 not started, or not at MASTER_ADDR:MASTER_PORT; "
          "a firewall?); the last attempt: {}",
          where_, why));
    std::this_thread::sleep_for(kSlice);
  }
  call(wire::Writer().byte(wire::kHello).field(wire::kMagic).frame(), "the greeting");
}

StoreClient::~StoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

void StoreClient::fail(const std::string& what, const std::string& why) {
  ::close(fd_);
  fd_ = -1;
  lost_ = why;
  throw std::runtime_error(
      fmt::format("the store at {} went away during {}: {} (node 0 ended, or stopped serving)",
                  where_, what, why));
}

std::string StoreClient::call(const std::string& request, const char* what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_ < 0)
    throw std::runtime_error(
        fmt::format("the connection to the store at {} was lost: {}", where_, lost_));
  // A call that begins near the deadline still gets a second.
  const Deadline until{std::max(deadline_.at, SteadyClock::now() + std::chrono::seconds(1))};
  const std::string waiting = fmt::format("the store at {} ({})", where_, what);
  std::string reply;
  try {
    for (std::size_t sent = 0; sent < request.size();) {
      const ssize_t n =
          ::send(fd_, request.data() + sent, request.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0) {
        sent += static_cast<std::size_t>(n);
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        await(fd_, POLLOUT, until, waiting);
      } else if (errno != EINTR) {
        fail(what, std::strerror(errno));
      }
    }
    const auto receive = [&](std::size_t count) {
      std::string out(count, '\0');
      for (std::size_t got = 0; got < count;) {
        const ssize_t n = ::recv(fd_, &out[got], count - got, MSG_DONTWAIT);
        if (n > 0) {
          got += static_cast<std::size_t>(n);
        } else if (n == 0) {
          fail(what, "the server closed the connection");
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
          await(fd_, POLLIN, until, waiting);
        } else if (errno != EINTR) {
          fail(what, std::strerror(errno));
        }
      }
      return out;
    };
    const auto length = static_cast<std::size_t>(wire::readLE(receive(4).data(), 4));
    if (length == 0 || length > wire::kMaxFrame)
      fail(what, fmt::format("a reply of {} bytes, not gradagg's store", length));
    reply = receive(length);
  } catch (...) {
    if (fd_ >= 0) {  // cut off mid-frame (deadline, interrupt): the stream is lost
      ::close(fd_);
      fd_ = -1;
      lost_ = fmt::format("a call ({}) was cut off", what);
    }
    throw;
  }
  if (reply[0] == static_cast<char>(wire::kOk)) return reply.substr(1);
  wire::Reader refusal(reply);
  refusal.byte();
  throw std::runtime_error(
      fmt::format("the store at {} refused {}: {}", where_, what, refusal.field()));
}

namespace {
std::string text(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }
std::vector<uint8_t> bytesOf(const std::string& text) { return {text.begin(), text.end()}; }

// Throws when a reply has other fields than its request's.
void requireDone(const wire::Reader& r, const std::string& what) {
  if (!r.done()) throw std::runtime_error(fmt::format("a malformed reply to {}", what));
}
}  // namespace

void StoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  const std::string reply =
      call(wire::Writer().byte(wire::kSet).field(key).field(text(value)).frame(), "set");
  requireDone(wire::Reader(reply), "set");
}

std::vector<uint8_t> StoreClient::compareSet(const std::string& key,
                                             const std::vector<uint8_t>& expected,
                                             const std::vector<uint8_t>& desired) {
  const std::string reply = call(wire::Writer()
                                     .byte(wire::kCompareSet)
                                     .field(key)
                                     .field(text(expected))
                                     .field(text(desired))
                                     .frame(),
                                 "compareSet");
  wire::Reader r(reply);
  std::string now = r.field();
  requireDone(r, "compareSet");
  return bytesOf(now);
}

std::vector<uint8_t> StoreClient::get(const std::string& key) {
  const std::string reply = call(wire::Writer().byte(wire::kGet).field(key).frame(), "get");
  wire::Reader r(reply);
  std::string value = r.field();
  requireDone(r, "get");
  return bytesOf(value);
}

int64_t StoreClient::add(const std::string& key, int64_t value) {
  const std::string reply =
      call(wire::Writer().byte(wire::kAdd).field(key).number(value).frame(), "add");
  wire::Reader r(reply);
  const std::int64_t sum = r.number();
  requireDone(r, "add");
  return sum;
}

bool StoreClient::deleteKey(const std::string& key) {
  const std::string reply = call(wire::Writer().byte(wire::kDelete).field(key).frame(), "delete");
  wire::Reader r(reply);
  const bool was = r.byte() != 0;
  requireDone(r, "delete");
  return was;
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  wire::Writer w;
  w.byte(wire::kCheck).number(static_cast<std::int64_t>(keys.size()));
  for (const auto& key : keys) w.field(key);
  const std::string reply = call(w.frame(), "check");
  wire::Reader r(reply);
  const bool all = r.byte() != 0;
  requireDone(r, "check");
  return all;
}

int64_t StoreClient::getNumKeys() {
  const std::string reply = call(wire::Writer().byte(wire::kNumKeys).frame(), "getNumKeys");
  wire::Reader r(reply);
  const std::int64_t n = r.number();
  requireDone(r, "getNumKeys");
  return n;
}

void StoreClient::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void StoreClient::wait(const std::vector<std::string>& keys,
                       const std::chrono::milliseconds& timeout) {
  const Deadline until{std::min(deadline_.at, SteadyClock::now() + timeout)};
  pollUntil(until, "the store's keys", [&] { return check(keys); });
}

}  // namespace gradagg::detail
