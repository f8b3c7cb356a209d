#include "topology/startup/admission.h"

#include <sstream>
#include <vector>

#include <fmt/format.h>

#include <gradagg/errors.h>

#include "topology/startup/job_token.h"

namespace gradagg::detail {

namespace {

std::string text(c10d::Store& store, const std::string& key) {
  const auto bytes = store.get(key);
  return std::string(bytes.begin(), bytes.end());
}

void put(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<std::uint8_t>(value.begin(), value.end()));
}

// "R n proof", as node 0 acks and node r confirms.
struct Signed {
  std::string run, nonce, proof;
};

Signed parse(const std::string& s) {
  Signed out;
  std::istringstream in(s);
  in >> out.run >> out.nonce >> out.proof;
  return out;
}

std::string statement(const char* what, const std::string& run, int rank, const std::string& n) {
  return fmt::format("{} {} {} {}", what, run, rank, n);
}

std::string sign(const NodeOptions& o, const char* what, const std::string& run, int rank,
                 const std::string& nonce) {
  return fmt::format("{} {} {}", run, nonce, proofOf(o.token, statement(what, run, rank, nonce)));
}

[[noreturn]] void refuse(const NodeOptions& o, int other, const std::string& proof) {
  const std::string whose = o.token.empty() ? "this node has no job token and node {} has one"
                            : proof == "-"  ? "this node has a job token and node {} has none"
                                            : "node {} proves a different job token";
  // With a token, whoever wrote under node `other`'s keys may be no node of
  // the job at all: the store is open to anyone who reaches its port.
  const std::string stranger =
      o.token.empty() ? ""
                      : fmt::format(
                            "; if every node has it, a process outside the job answered "
                            "as node {} (docs/multinode.md, Security)",
                            other);
  throw InvalidArgument(
      fmt::format("gradagg: node {} of {}: refused at the rendezvous: {} (NodeOptions::token, "
                  "GRADAGG_JOB_TOKEN): give every node of the job the same token{}",
                  o.node_rank, o.nodes, fmt::format(fmt::runtime(whose), other), stranger));
}

std::string privatePrefix(const NodeOptions& o, const std::string& run) {
  return o.token.empty() ? run : proofOf(o.token, "keys " + run).substr(0, 32);
}

std::string admitOthers(c10d::Store& store, const NodeOptions& o, const Deadline& deadline,
                        const std::function<void()>& between) {
  const std::string run = randomHex(16);
  const auto key = [&](const char* what, int r) {
    return fmt::format("{}/{}/{}", o.store_prefix, what, r);
  };
  std::vector<std::string> seen(static_cast<std::size_t>(o.nodes));
  std::vector<bool> confirmed(static_cast<std::size_t>(o.nodes), false);
  int left = o.nodes - 1;
  pollUntil(deadline, fmt::format("the other {} nodes to join", o.nodes - 1), [&] {
    for (int r = 1; r < o.nodes; ++r) {
      const auto i = static_cast<std::size_t>(r);
      if (confirmed[i]) continue;
      if (store.check({key("join", r)})) {
        const std::string nonce = text(store, key("join", r));
        if (nonce != seen[i]) {  // the first one read may have been a dead run's
          seen[i] = nonce;
          put(store, key("ack", r), sign(o, "ack", run, r, nonce));
        }
      }
      if (seen[i].empty() || !store.check({key("confirm", r)})) continue;
      const Signed c = parse(text(store, key("confirm", r)));
      if (c.run != run || c.nonce != seen[i]) continue;  // a dead run's, or not yet
      if (!sameProof(c.proof, proofOf(o.token, statement("confirm", run, r, seen[i]))))
        refuse(o, r, c.proof);
      confirmed[i] = true;
      --left;
    }
    between();
    return left == 0;
  });
  std::string prefix = privatePrefix(o, run);
  put(store, fmt::format("{}/{}/ready", o.store_prefix, prefix), "1");
  return prefix;
}

std::string joinNode0(c10d::Store& store, const NodeOptions& o, const Deadline& deadline,
                      const std::function<void()>& between) {
  const int r = o.node_rank;
  const std::string nonce = randomHex(16);
  const std::string ack_key = fmt::format("{}/ack/{}", o.store_prefix, r);
  put(store, fmt::format("{}/join/{}", o.store_prefix, r), nonce);
  Signed ack;
  pollUntil(deadline, "node 0 to admit this node", [&] {
    between();
    if (!store.check({ack_key})) return false;
    ack = parse(text(store, ack_key));
    return ack.nonce == nonce;  // else a dead run's
  });
  put(store, fmt::format("{}/confirm/{}", o.store_prefix, r),
      sign(o, "confirm", ack.run, r, nonce));
  if (!sameProof(ack.proof, proofOf(o.token, statement("ack", ack.run, r, nonce))))
    refuse(o, 0, ack.proof);
  std::string prefix = privatePrefix(o, ack.run);
  const std::string ready = fmt::format("{}/{}/ready", o.store_prefix, prefix);
  pollUntil(deadline, "node 0 to admit every node", [&] {
    between();
    return store.check({ready});
  });
  return prefix;
}

}  // namespace

std::string admit(c10d::Store& store, const NodeOptions& o, const Deadline& deadline,
                  const std::function<void()>& between) {
  return o.node_rank == 0 ? admitOthers(store, o, deadline, between)
                          : joinNode0(store, o, deadline, between);
}

}  // namespace gradagg::detail
