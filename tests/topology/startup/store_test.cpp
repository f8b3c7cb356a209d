// Node 0's store (store_server.h) through its client (store_client.h): every
// call answers as c10d's FileStore does for the same calls (the reference:
// c10d's own rules, compareSet's included), a connection that holds part of a
// frame does not keep the others waiting, and a server that goes away is an
// error from the next call, in the calling thread.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include "runtime/temp_dir.h"
#include "topology/startup/store_client.h"
#include "topology/startup/store_server.h"

namespace gradagg_test {
namespace {

using gradagg::detail::Deadline;
using gradagg::detail::SteadyClock;
using gradagg::detail::StoreClient;
using gradagg::detail::StoreServer;
using namespace std::chrono_literals;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// A port free on loopback now, and a plain connection to it.
int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}
int connectTo(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
  ::close(fd);
  return -1;
}

// The same calls on two stores; what each answered, as text.
std::vector<std::string> script(c10d::Store& s) {
  std::vector<std::string> said;
  s.set("a", bytes("1"));
  said.push_back(text(s.get("a")));
  said.push_back(std::to_string(s.add("n", 3)));
  said.push_back(std::to_string(s.add("n", -10)));
  said.push_back(text(s.get("n")));
  said.push_back(text(s.compareSet("c", {}, bytes("x"))));          // missing, nothing expected
  said.push_back(text(s.compareSet("d", bytes("e"), bytes("x"))));  // missing, something expected
  said.push_back(text(s.compareSet("c", bytes("x"), bytes("y"))));  // as expected
  said.push_back(text(s.compareSet("c", bytes("z"), bytes("w"))));  // not as expected
  said.push_back(std::to_string(s.check({"a", "c", "n"})));
  said.push_back(std::to_string(s.check({"a", "d"})));
  s.set("a", std::vector<uint8_t>(100000, 7));  // a long value, replaced
  said.push_back(std::to_string(s.get("a").size()));
  return said;
}

TEST(Store, AnswersEveryCallAsC10dsFileStoreDoes) {
  gradagg::detail::TempDir dir("store");
  c10d::FileStore reference(dir.file("f"), 1);
  const Deadline deadline{SteadyClock::now() + 10s};
  const int port = freePort();
  StoreServer server(port, deadline);
  StoreClient client("127.0.0.1", port, deadline);
  EXPECT_EQ(script(client), script(reference));
  EXPECT_EQ(client.getNumKeys(), 3);  // a, n, c
  EXPECT_TRUE(client.deleteKey("a"));
  EXPECT_FALSE(client.deleteKey("a"));
  EXPECT_FALSE(client.check({"a"}));
  EXPECT_THROW(client.get("a"), std::runtime_error);  // no such key
  EXPECT_EQ(client.add("n", 1), -6);                  // the connection is still fine
}

TEST(Store, AConnectionHoldingPartOfAFrameKeepsNoOneWaitingAndIsClosed) {
  const Deadline deadline{SteadyClock::now() + 10s};
  const int port = freePort();
  StoreServer server(port, deadline);
  const int stray = connectTo(port);
  ASSERT_GE(stray, 0);
  ASSERT_EQ(::write(stray, "\x01", 1), 1);  // a frame's first byte, and no more
  StoreClient client("127.0.0.1", port, deadline);
  const auto began = SteadyClock::now();
  client.set("k", bytes("v"));
  EXPECT_EQ(text(client.get("k")), "v");
  EXPECT_LT(SteadyClock::now() - began, 500ms);  // served at once, not after the stray
  // The stray is closed after StoreServer::kStallLimit.
  char c = 0;
  EXPECT_EQ(::read(stray, &c, 1), 0) << "the stray's connection is still open";
  ::close(stray);
}

TEST(Store, AServerThatGoesAwayIsAnErrorFromTheNextCall) {
  const Deadline deadline{SteadyClock::now() + 10s};
  const int port = freePort();
  StoreServer server(port, deadline);
  StoreClient client("127.0.0.1", port, deadline);
  client.set("k", bytes("v"));
  server.stop();
  const auto began = SteadyClock::now();
  EXPECT_THROW(client.check({"k"}), std::runtime_error);
  EXPECT_THROW(client.check({"k"}), std::runtime_error);  // and from every call after
  EXPECT_LT(SteadyClock::now() - began, 1s);
}

}  // namespace
}  // namespace gradagg_test
