// What a process outside the job can read from the rendezvous store. The store
// is open to whoever reaches it (c10d has no access control); with a job token
// the keys an outsider can name (join, ack, confirm) hold nonces, a run id and
// HMAC proofs, and every later key (the Gloo addresses, the start-up exchanges)
// lies under a prefix derived from the token, which no public value names.
// A FileStore holds every key and value in its file, as an outsider that
// listens to the store would see them all.
#include <cstring>
#include <fstream>
#include <future>
#include <iterator>
#include <string>
#include <utility>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <gradagg/options.h>

#include "runtime/temp_dir.h"
#include "topology/startup/admission.h"

namespace gradagg_test {
namespace {

using gradagg::detail::Deadline;
using gradagg::detail::SteadyClock;
using gradagg::detail::TempDir;

struct Admitted {
  std::string prefix0, prefix1, file;
};

// Nodes 0 and 1 admit each other through one FileStore; a key under the
// private prefix stands for the Gloo mesh's addresses that come next.
Admitted admitTwo(const std::string& path, const std::string& token) {
  const auto side = [&](int rank) {
    auto store = c10::make_intrusive<c10d::FileStore>(path, 2);
    gradagg::NodeOptions o;
    o.nodes = 2;
    o.node_rank = rank;
    o.token = token;
    const Deadline deadline{SteadyClock::now() + std::chrono::seconds(20)};
    const std::string prefix = gradagg::detail::admit(*store, o, deadline, [] {});
    const std::string address = "gloo address of node " + std::to_string(rank);
    store->set(o.store_prefix + "/" + prefix + "/step/" + std::to_string(rank),
               std::vector<std::uint8_t>(address.begin(), address.end()));
    return std::make_pair(prefix, store);  // the last store let go removes the file
  };
  auto node1 = std::async(std::launch::async, side, 1);
  const auto node0 = side(0);
  const auto other = node1.get();
  Admitted a;
  a.prefix0 = node0.first;
  a.prefix1 = other.first;
  std::ifstream in(path, std::ios::binary);
  a.file.assign(std::istreambuf_iterator<char>(in), {});
  return a;
}

// The run id node 0 put in its ack to node 1 ("<run> <nonce> <proof>").
std::string runIdIn(const std::string& file) {
  const std::string key = "gradagg/ack/1";
  const auto at = file.find(key);
  if (at == std::string::npos) return "";
  // Past the value's length (binary): the first 32 hex digits and a space.
  for (auto p = at + key.size(); p + 33 <= file.size() && p < at + key.size() + 16; ++p) {
    const std::string run = file.substr(p, 32);
    if (run.find_first_not_of("0123456789abcdef") == std::string::npos && file[p + 32] == ' ')
      return run;
  }
  return "";
}

TEST(Admission, WithATokenNoKeyAnOutsiderCanNameLeadsToTheGlooAddresses) {
  TempDir dir("admission");
  const std::string token = "the job's token 7f3a";
  const Admitted a = admitTwo(dir.file("store"), token);
  ASSERT_EQ(a.prefix0, a.prefix1);
  const std::string run = runIdIn(a.file);
  ASSERT_EQ(run.size(), 32u) << "no ack to node 1 in the store";
  EXPECT_EQ(a.file.find(token), std::string::npos) << "the token is in the store";
  EXPECT_NE(a.prefix0, run);
  EXPECT_EQ(a.file.find("gradagg/" + run + "/"), std::string::npos)
      << "keys named by the run id, which anyone reads from the ack";
  EXPECT_NE(a.file.find("gradagg/" + a.prefix0 + "/step/0"), std::string::npos)
      << "the private keys are not where this test looks";
  // The prefix appears in key names only, never in a value an outsider reads first.
  for (const char* key : {"gradagg/join/1", "gradagg/ack/1", "gradagg/confirm/1"}) {
    const auto at = a.file.find(key);
    ASSERT_NE(at, std::string::npos) << key;
    const std::size_t value = std::strlen(key) + 8 + 32 + 1 + 32 + 1 + 64;  // run nonce proof
    EXPECT_EQ(a.file.substr(at, value).find(a.prefix0), std::string::npos) << key;
  }
}

// Without a token the private prefix is the run id, which the ack shows:
// anyone who reaches the store can find the Gloo addresses (docs/multinode.md, Security).
TEST(Admission, WithoutATokenThePrivateKeysAreNamedByTheRunIdAnyoneReads) {
  TempDir dir("admission");
  const Admitted a = admitTwo(dir.file("store"), "");
  EXPECT_EQ(a.prefix0, runIdIn(a.file));
}

}  // namespace
}  // namespace gradagg_test
