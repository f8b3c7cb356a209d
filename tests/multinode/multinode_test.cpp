// Several nodes on loopback: two process trees, each an Aggregator whose parent
// joins the others through c10d Gloo (FileStore rendezvous in a temp dir).
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <thread>

#include "core/temp_dir.h"
#include "support/support.h"

namespace gradagg_test {
namespace {

using namespace std::chrono_literals;

struct NodeRun {
  int node = 0;
  int nodes = 1;
  int workers = 2;
  ModelKind kind = ModelKind::kMlp;
  int64_t batch = 24;
  int steps = 4;
  bool unequal = false;
  std::string store;
  std::chrono::milliseconds timeout{20000};
  int kill_self_at_step = -1;  // this node's parent dies (SIGKILL) during that step
  int perturb_after_step = -1;  // this node's parameters drift after that step
  int stop_self_at_step = -1;   // this node's parent stops (SIGSTOP) during that step: a stall
};

// What a node process sends back: an outcome code and its parameters.
enum Outcome : int { kOk = 0, kNodeFailed = 1, kInvalidArgument = 2, kOther = 3 };

// Trains on this node: worker r takes the global shard of global rank offset + r.
std::vector<torch::Tensor> trainNode(const NodeRun& run, Outcome* outcome, std::string* what) {
  auto model = makeModel(run.kind, torch::kDouble);
  const Data data = makeData(run.kind, run.batch, torch::kDouble);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.5));
  gradagg::Options o;
  o.workers = run.workers;
  o.step_timeout = 60s;
  o.nodes.nodes = run.nodes;
  o.nodes.node_rank = run.node;
  o.nodes.store_path = run.store;
  o.nodes.interface = "lo";
  o.nodes.timeout = run.timeout;
  o.nodes.checksum_interval = 2;
  *outcome = kOther;
  try {
    const int kill_at = run.kill_self_at_step;
    gradagg::Aggregator agg(*model, [&, kill_at](const gradagg::ShardContext& c) {
      if (c.step == kill_at && c.rank == 0) ::kill(::getppid(), SIGKILL);
      if (c.step == run.stop_self_at_step && c.rank == 0) ::kill(::getppid(), SIGSTOP);
      const auto bounds = shardBounds(run.batch, c.global_workers, run.unequal);
      const int64_t b = bounds[c.global_rank], e = bounds[c.global_rank + 1];
      auto loss = model->loss(model->forward(data.x.slice(0, b, e)), data.y.slice(0, b, e));
      return gradagg::ShardResult{loss, e - b};
    }, o);
    for (int s = 0; s < run.steps; ++s) {
      sgd.zero_grad();
      agg.step();
      sgd.step();
      if (s == run.perturb_after_step) {
        torch::NoGradGuard no_grad;
        model->parameters()[0].add_(1e-3);
      }
    }
    *outcome = kOk;
  } catch (const gradagg::NodeFailed& e) {
    *outcome = kNodeFailed;
    *what = e.what();
  } catch (const gradagg::InvalidArgument& e) {
    *outcome = kInvalidArgument;
    *what = e.what();
  } catch (const std::exception& e) {
    *what = e.what();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

struct NodeResult {
  Outcome outcome = kOther;
  std::string what;
  std::vector<torch::Tensor> params;
  double seconds = 0;
};

// Starts one process per node, collects what each sends back through a pipe.
std::vector<NodeResult> runNodes(std::vector<NodeRun> runs) {
  std::vector<std::pair<pid_t, int>> children;
  for (const NodeRun& run : runs) {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      Outcome outcome;
      std::string what;
      const auto t0 = std::chrono::steady_clock::now();
      auto params = trainNode(run, &outcome, &what);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::ostringstream buf;
      torch::save(params, buf);
      const std::string blob = buf.str();
      const int64_t header[3] = {outcome, static_cast<int64_t>(what.size()),
                                 static_cast<int64_t>(blob.size())};
      (void)!::write(fds[1], header, sizeof(header));
      (void)!::write(fds[1], &seconds, sizeof(seconds));
      (void)!::write(fds[1], what.data(), what.size());
      for (size_t at = 0; at < blob.size();) {
        const ssize_t n = ::write(fds[1], blob.data() + at, blob.size() - at);
        if (n <= 0) break;
        at += static_cast<size_t>(n);
      }
      ::_exit(0);
    }
    ::close(fds[1]);
    children.emplace_back(pid, fds[0]);
  }
  std::vector<NodeResult> results(runs.size());
  // Stalled nodes last: once the others have reported, they are killed.
  std::vector<size_t> order;
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].stop_self_at_step < 0) order.push_back(i);
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].stop_self_at_step >= 0) order.push_back(i);
  for (size_t i : order) {
    if (runs[i].stop_self_at_step >= 0) ::kill(children[i].first, SIGKILL);
    const int fd = children[i].second;
    auto readAll = [fd](void* p, size_t n) {
      size_t got = 0;
      while (got < n) {
        const ssize_t r = ::read(fd, static_cast<char*>(p) + got, n - got);
        if (r <= 0) return false;
        got += static_cast<size_t>(r);
      }
      return true;
    };
    int64_t header[3];
    if (readAll(header, sizeof(header))) {
      results[i].outcome = static_cast<Outcome>(header[0]);
      readAll(&results[i].seconds, sizeof(double));
      results[i].what.resize(header[1]);
      readAll(results[i].what.data(), header[1]);
      std::string blob(header[2], '\0');
      readAll(blob.data(), blob.size());
      std::istringstream in(blob);
      torch::load(results[i].params, in);
    }
    ::close(fd);
    int status;
    ::waitpid(children[i].first, &status, 0);
  }
  return results;
}

class MultiNode : public GradaggTest {
 protected:
  // A FileStore path for one group of nodes, in a directory of this test's own.
  std::string store(const std::string& name) const { return dir_.file(name); }
  gradagg::detail::TempDir dir_{"nodes"};
};

std::vector<torch::Tensor> trainOneNode(int workers, const NodeRun& like) {
  NodeRun run = like;
  run.nodes = 1;
  run.node = 0;
  run.workers = workers;
  Outcome outcome;
  std::string what;
  auto params = trainNode(run, &outcome, &what);
  EXPECT_EQ(outcome, kOk) << what;
  return params;
}

TEST_F(MultiNode, TwoNodesOfTwoWorkersMatchOneNodeOfFourAndAgreeBitwise) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("a");
  NodeRun other = run;
  other.node = 1;
  const auto results = runNodes({run, other});
  ASSERT_EQ(results[0].outcome, kOk) << results[0].what;
  ASSERT_EQ(results[1].outcome, kOk) << results[1].what;
  const auto reference = trainOneNode(4, run);
  // Float64: the two sums differ in order only; 1e-12 relative.
  expectClose(results[0].params, reference, 1e-12, "node 0 vs one node of 4");
  for (size_t k = 0; k < reference.size(); ++k)
    EXPECT_TRUE(torch::equal(results[0].params[k], results[1].params[k])) << "tensor " << k;
}

TEST_F(MultiNode, UnequalWorkerCountsStillGiveTheGlobalSampleWeightedMean) {
  NodeRun run;
  run.nodes = 2;
  run.kind = ModelKind::kConvBnEval;
  run.unequal = true;
  run.batch = 18;
  run.store = store("b");
  NodeRun other = run;
  other.node = 1;
  other.workers = 1;
  const auto results = runNodes({run, other});
  ASSERT_EQ(results[0].outcome, kOk) << results[0].what;
  ASSERT_EQ(results[1].outcome, kOk) << results[1].what;
  // Independent: one process, full batch, plain autograd and SGD.
  auto model = makeModel(run.kind, torch::kDouble);
  const Data data = makeData(run.kind, run.batch, torch::kDouble);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.5));
  for (int s = 0; s < run.steps; ++s) {
    sgd.zero_grad();
    model->loss(model->forward(data.x), data.y).backward();
    sgd.step();
  }
  std::vector<torch::Tensor> want;
  for (auto& p : model->parameters()) want.push_back(p.detach());
  expectClose(results[0].params, want, 1e-10, "2 + 1 workers vs one process");
  for (size_t k = 0; k < want.size(); ++k)
    EXPECT_TRUE(torch::equal(results[0].params[k], results[1].params[k])) << "tensor " << k;
}

TEST_F(MultiNode, AKilledNodeEndsTheOtherWithNodeFailedWithinTheTimeout) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("c");
  run.timeout = 5000ms;
  run.steps = 6;
  NodeRun other = run;
  other.node = 1;
  other.kill_self_at_step = 2;
  const auto results = runNodes({run, other});
  EXPECT_EQ(results[0].outcome, kNodeFailed) << results[0].what;
  EXPECT_NE(results[0].what.find("node 0 of 2"), std::string::npos) << results[0].what;
  EXPECT_LT(results[0].seconds, 5.0 + 10.0);  // the timeout, plus start-up
}

TEST_F(MultiNode, AStalledNodeEndsTheOtherWithNodeFailedAfterTheTimeout) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("f");
  run.timeout = 2000ms;
  run.steps = 6;
  NodeRun other = run;
  other.node = 1;
  other.stop_self_at_step = 2;
  const auto results = runNodes({run, other});
  EXPECT_EQ(results[0].outcome, kNodeFailed) << results[0].what;
  EXPECT_GE(results[0].seconds, 2.0);        // it waited for the deadline...
  EXPECT_LT(results[0].seconds, 2.0 + 15.0);  // ...and not much longer
}

TEST_F(MultiNode, DivergedParametersAreCaughtByTheChecksumOnEveryNode) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("e");
  run.steps = 6;  // checksums before steps 2 and 4
  NodeRun other = run;
  other.node = 1;
  other.perturb_after_step = 2;
  const auto results = runNodes({run, other});
  for (const auto& r : results) {
    EXPECT_EQ(r.outcome, kNodeFailed) << r.what;
    EXPECT_NE(r.what.find("diverged"), std::string::npos) << r.what;
    EXPECT_NE(r.what.find("node(s) 1"), std::string::npos) << r.what;
  }
}

TEST_F(MultiNode, DifferentModelsAreAClearErrorOnEveryNode) {
  NodeRun run;
  run.nodes = 2;
  run.store = store("d");
  NodeRun other = run;
  other.node = 1;
  other.kind = ModelKind::kLinear;
  const auto results = runNodes({run, other});
  for (const auto& r : results) {
    EXPECT_EQ(r.outcome, kInvalidArgument) << r.what;
    EXPECT_NE(r.what.find("different model"), std::string::npos) << r.what;
  }
}

TEST(NodeOptions, FromEnvironmentReadsTorchrunStyleVariables) {
  ::setenv("GRADAGG_NNODES", "3", 1);
  ::setenv("GRADAGG_NODE_RANK", "2", 1);
  ::setenv("MASTER_ADDR", "10.1.2.3", 1);
  ::setenv("MASTER_PORT", "29999", 1);
  const auto o = gradagg::NodeOptions::fromEnvironment();
  EXPECT_EQ(o.nodes, 3);
  EXPECT_EQ(o.node_rank, 2);
  EXPECT_EQ(o.master_addr, "10.1.2.3");
  EXPECT_EQ(o.master_port, 29999);
  ::setenv("GRADAGG_NODE_RANK", "two", 1);
  EXPECT_THROW(gradagg::NodeOptions::fromEnvironment(), gradagg::InvalidArgument);
  for (const char* v : {"GRADAGG_NNODES", "GRADAGG_NODE_RANK", "MASTER_ADDR", "MASTER_PORT"})
    ::unsetenv(v);
}

}  // namespace
}  // namespace gradagg_test
