// A peer node that closes its connections while this node still writes to them
// (it died, or gave up at its own timeout a moment earlier) makes gloo's next
// write fail with EPIPE, which raises SIGPIPE in the writing thread. A C++
// program keeps SIGPIPE's default action, death without a word: the node must
// end with NodeFailed instead (seen once in CI: a node of the slow-link test
// ended silently while its peer had timed out first).
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <gradagg/errors.h>
#include <gradagg/options.h>

#include "runtime/temp_dir.h"
#include "topology/group/node_group.h"

namespace gradagg_test {
namespace {

using namespace std::chrono_literals;

constexpr int kNodeFailedExit = 3;
constexpr int kOtherErrorExit = 4;

gradagg::NodeOptions nodeOptions(int rank, const std::string& store,
                                 std::chrono::milliseconds timeout) {
  gradagg::NodeOptions o;
  o.nodes = 2;
  o.node_rank = rank;
  o.store_path = store;
  o.timeout = timeout;
  return o;
}

// Forks a node that runs body(group) after the rendezvous and exits 0, or
// kNodeFailedExit on NodeFailed, kOtherErrorExit on anything else.
template <typename F>
pid_t forkNode(int rank, const std::string& store, F body) {
  const pid_t test = ::getpid();
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != test) ::_exit(1);
  try {
    gradagg::detail::NodeGroup group(nodeOptions(rank, store, 20000ms));
    group.endRendezvous();
    body(group);
    ::_exit(0);
  } catch (const gradagg::NodeFailed& e) {
    std::fprintf(stderr, "node %d: %s\n", rank, e.what());
    ::_exit(kNodeFailedExit);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "node %d: unexpected: %s\n", rank, e.what());
    ::_exit(kOtherErrorExit);
  }
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + ::strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

TEST(BrokenPipe, APeerThatLeavesMidTransferEndsThisNodeWithNodeFailedNotSigpipe) {
  gradagg::detail::TempDir dir("pipe");
  const std::string store = dir.path() + "/store";
  // 256 MiB: the transfer lasts long enough for node 1 to leave in the middle.
  constexpr int64_t kElements = 64ll << 20;
  // Node 1 receives, then leaves abruptly (its sockets closed with unread
  // data: a reset) a moment after the transfer began.
  const pid_t node1 = forkNode(1, store, [](gradagg::detail::NodeGroup& group) {
    std::thread leave([] {
      std::this_thread::sleep_for(20ms);
      ::_exit(0);
    });
    at::Tensor t = torch::zeros({kElements});
    for (;;) group.broadcastFromNode0(t, "the test's broadcast");
  });
  // Node 0 keeps sending until a write fails.
  const pid_t node0 = forkNode(0, store, [](gradagg::detail::NodeGroup& group) {
    at::Tensor t = torch::ones({kElements});
    for (;;) group.broadcastFromNode0(t, "the test's broadcast");
  });
  int status0 = 0, status1 = 0;
  ASSERT_EQ(::waitpid(node0, &status0, 0), node0);
  ASSERT_EQ(::waitpid(node1, &status1, 0), node1);
  EXPECT_TRUE(WIFEXITED(status0) && WEXITSTATUS(status0) == kNodeFailedExit)
      << "node 0 ended with " << describe(status0) << ", not NodeFailed";
  EXPECT_TRUE(WIFEXITED(status1)) << "node 1 ended with " << describe(status1);
}

// The threads behind the test above are c10d's and gloo's, started during the
// rendezvous: every one of them has SIGPIPE blocked (a peer's reset in any of
// them is EPIPE), and the caller's own mask is as it was, after the
// rendezvous and after a collective.
std::set<std::string> threads() {
  std::set<std::string> tids;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task"))
    tids.insert(e.path().filename().string());
  return tids;
}

bool sigpipeBlocked(const std::string& tid) {
  std::ifstream status("/proc/self/task/" + tid + "/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("SigBlk:", 0) == 0)
      return (std::stoull(line.substr(7), nullptr, 16) >> (SIGPIPE - 1)) & 1u;
  return false;  // gone meanwhile
}

TEST(BrokenPipe, EveryThreadTheNodeGroupStartsHasSigpipeBlockedAndTheCallerKeepsItsMask) {
  gradagg::detail::TempDir dir("pipe");
  const std::string store = dir.path() + "/store";
  const pid_t node1 = forkNode(1, store, [](gradagg::detail::NodeGroup& group) {
    at::Tensor t = torch::zeros({1024});
    group.broadcastFromNode0(t, "the test's broadcast");
  });
  const pid_t test = ::getpid();
  const pid_t node0 = ::fork();
  if (node0 == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != test) ::_exit(1);
    const std::string self = std::to_string(::gettid());
    const std::set<std::string> before = threads();  // this thread alone: fork copies one
    gradagg::detail::NodeGroup group(nodeOptions(0, store, 20000ms));
    int bad = 0;
    for (const std::string& tid : threads())
      if (before.count(tid) == 0 && !sigpipeBlocked(tid)) {
        std::fprintf(stderr, "thread %s started by the NodeGroup has SIGPIPE unblocked\n",
                     tid.c_str());
        ++bad;
      }
    if (sigpipeBlocked(self)) ++bad, std::fprintf(stderr, "the caller's mask changed\n");
    group.endRendezvous();
    at::Tensor t = torch::ones({1024});
    group.broadcastFromNode0(t, "the test's broadcast");
    if (sigpipeBlocked(self))
      ++bad, std::fprintf(stderr, "a collective changed the caller's mask\n");
    ::_exit(bad == 0 ? 0 : 10);
  }
  int status0 = 0, status1 = 0;
  ASSERT_EQ(::waitpid(node0, &status0, 0), node0);
  ASSERT_EQ(::waitpid(node1, &status1, 0), node1);
  EXPECT_TRUE(WIFEXITED(status0) && WEXITSTATUS(status0) == 0) << "node 0: " << describe(status0);
  EXPECT_TRUE(WIFEXITED(status1) && WEXITSTATUS(status1) == 0) << "node 1: " << describe(status1);
}

}  // namespace
}  // namespace gradagg_test
