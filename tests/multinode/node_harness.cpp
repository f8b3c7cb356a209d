#include "node_harness.h"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <sstream>
#include <utility>

namespace gradagg_test {

using namespace std::chrono_literals;

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

}  // namespace gradagg_test
