#include "node_harness.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

namespace gradagg_test {

using namespace std::chrono_literals;

namespace {

// 0.5 * sum(p), whose backward runs a backward of its own over p (a reentrant
// backward, as torch.utils.checkpoint(use_reentrant=True) does): p's gradient
// accumulator runs there, and again for the model's own use of p.
struct ReentrantHalfSum : torch::autograd::Function<ReentrantHalfSum> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& p) {
    ctx->save_for_backward({p});
    return p.detach().sum() * 0.5;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const torch::Tensor p = ctx->get_saved_variables()[0];
    torch::Tensor again;
    {
      torch::AutoGradMode on(true);
      again = p.sum() * 0.5;
    }
    torch::autograd::backward({again}, {grad[0]});
    return {torch::Tensor()};
  }
};

// Calls f() and says how it ended, keeping the error's message in *what.
template <typename F>
Outcome outcomeOf(F&& f, std::string* what) {
  try {
    f();
    return kOk;
  } catch (const gradagg::Interrupted& e) {
    *what = e.what();
    return kInterrupted;
  } catch (const gradagg::NodeFailed& e) {
    *what = e.what();
    return kNodeFailed;
  } catch (const gradagg::NotUsable& e) {
    *what = e.what();
    return kNotUsable;
  } catch (const gradagg::WorkerDied& e) {
    *what = e.what();
    return kWorkerDied;
  } catch (const gradagg::WorkerFailed& e) {
    *what = e.what();
    return kWorkerFailed;
  } catch (const gradagg::InvalidArgument& e) {
    *what = e.what();
    return kInvalidArgument;
  } catch (const std::exception& e) {
    *what = e.what();
    return kOther;
  }
}

// The pipe from a node process to the test: plain bytes, lengths first.
void writeAll(int fd, const void* data, size_t n) {
  for (size_t at = 0; at < n;) {
    const ssize_t w = ::write(fd, static_cast<const char*>(data) + at, n - at);
    if (w <= 0) return;
    at += static_cast<size_t>(w);
  }
}

bool readAll(int fd, void* data, size_t n) {
  for (size_t got = 0; got < n;) {
    const ssize_t r = ::read(fd, static_cast<char*>(data) + got, n - got);
    if (r <= 0) return false;
    got += static_cast<size_t>(r);
  }
  return true;
}

// Metrics as "name value" lines, in full precision.
std::string encode(const std::map<std::string, double>& metrics) {
  std::ostringstream out;
  out.precision(17);
  for (const auto& [name, value] : metrics) out << name << ' ' << value << '\n';
  return out.str();
}

std::map<std::string, double> decode(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string name;
  double value;
  while (in >> name >> value) out[name] = value;
  return out;
}

void send(int fd, const NodeResult& r) {
  std::ostringstream buf;
  torch::save(r.params, buf);
  const std::string blob = buf.str();
  const std::string metrics = encode(r.metrics) + "--\n" + encode(r.worker0_metrics);
  const int64_t header[13] = {r.outcome,
                              r.usable_after,
                              r.children_after,
                              r.retry,
                              static_cast<int64_t>(r.what.size()),
                              static_cast<int64_t>(r.retry_what.size()),
                              static_cast<int64_t>(blob.size()),
                              static_cast<int64_t>(r.node_bytes),
                              r.collectives,
                              r.overlapped,
                              static_cast<int64_t>(metrics.size()),
                              r.max_rss_mib,
                              r.restarts};
  writeAll(fd, header, sizeof(header));
  writeAll(fd, &r.seconds, sizeof(r.seconds));
  writeAll(fd, r.what.data(), r.what.size());
  writeAll(fd, r.retry_what.data(), r.retry_what.size());
  writeAll(fd, blob.data(), blob.size());
  writeAll(fd, metrics.data(), metrics.size());
}

// Nothing (outcome kOther) when the node died before it sent anything.
NodeResult receive(int fd) {
  NodeResult r;
  int64_t header[13];
  if (!readAll(fd, header, sizeof(header))) return r;
  r.restarts = static_cast<int>(header[12]);
  r.max_rss_mib = header[11];
  r.collectives = static_cast<int>(header[8]);
  r.overlapped = static_cast<int>(header[9]);
  r.node_bytes = static_cast<std::uint64_t>(header[7]);
  r.outcome = static_cast<Outcome>(header[0]);
  r.usable_after = header[1] != 0;
  r.children_after = static_cast<int>(header[2]);
  r.retry = static_cast<Outcome>(header[3]);
  r.what.resize(header[4]);
  r.retry_what.resize(header[5]);
  std::string blob(header[6], '\0');
  readAll(fd, &r.seconds, sizeof(r.seconds));
  readAll(fd, r.what.data(), r.what.size());
  readAll(fd, r.retry_what.data(), r.retry_what.size());
  readAll(fd, blob.data(), blob.size());
  std::string metrics(header[10], '\0');
  readAll(fd, metrics.data(), metrics.size());
  std::istringstream in(blob);
  torch::load(r.params, in);
  const auto split = metrics.find("--\n");
  if (split != std::string::npos) {
    r.metrics = decode(metrics.substr(0, split));
    r.worker0_metrics = decode(metrics.substr(split + 3));
  }
  return r;
}

}  // namespace

void PrintTo(Outcome outcome, std::ostream* os) {
  static const char* const names[] = {"ok",         "NodeFailed", "InvalidArgument",
                                      "other",      "NotUsable",  "WorkerFailed",
                                      "WorkerDied", "Interrupted"};
  *os << (outcome >= 0 && outcome <= kInterrupted ? names[outcome] : "?");
}

NodeResult trainNode(const NodeRun& run) {
  auto model = makeModel(run.kind, run.dtype);
  const Data data = makeData(run.kind, run.batch, run.dtype);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.5));
  gradagg::Options o;
  o.workers = run.workers;
  o.step_timeout = 60s;
  o.nodes.nodes = run.nodes;
  o.nodes.node_rank = run.node;
  o.nodes.store_path = run.master_port > 0 ? "" : run.store;
  o.nodes.master_addr = run.master_addr;
  o.nodes.token = run.token;
  o.nodes.master_port = run.master_port;
  o.nodes.external_store = run.external_store;
  o.nodes.store_prefix = run.store_prefix;
  o.nodes.compression = run.compression;
  o.nodes.bucket_bytes = run.bucket_bytes;
  o.nodes.first_bucket_bytes = std::min(run.bucket_bytes, o.nodes.first_bucket_bytes);
  o.nodes.overlap = run.overlap;
  o.accumulation_steps = run.accumulation_steps;
  o.start_step = run.start_step;
  o.nodes.resume_identity = run.resume_identity;
  o.nodes.must_match = run.must_match;
  o.nodes.interface = "lo";
  o.nodes.timeout = run.timeout;
  o.nodes.checksum_interval = run.checksum_interval;
  o.weighting = run.weighting;
  o.max_restarts = run.max_restarts;
  // Whether kill_worker_once_at_step fired: shared with the workers forked later.
  void* const shared = ::mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) throw std::runtime_error("mmap failed");
  auto* killed = new (shared) std::atomic<int>(0);
  NodeResult result;
  std::optional<gradagg::Aggregator> agg;
  std::vector<std::thread> interrupters;  // each calls interruptWaits() after a while
  const auto interruptLater = [&] {
    interrupters.emplace_back([ms = run.interrupt_after_ms, patience = run.interrupt_patience_ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      if (patience > 0)
        gradagg::interruptWaits(std::chrono::milliseconds(patience));
      else
        gradagg::interruptWaits();
    });
  };
  result.outcome = outcomeOf(
      [&] {
        if (run.interrupt_after_ms >= 0 && run.interrupt_at_step < 0) interruptLater();
        if (run.stop_self_after_ms >= 0)
          std::thread([ms = run.stop_self_after_ms] {
            std::this_thread::sleep_for(std::chrono::milliseconds(ms));
            ::kill(::getpid(), SIGSTOP);
          }).detach();
        if (run.kill_self_after_ms >= 0)
          std::thread([ms = run.kill_self_after_ms] {
            std::this_thread::sleep_for(std::chrono::milliseconds(ms));
            ::kill(::getpid(), SIGKILL);
          }).detach();
        if (run.stop_children_after_ms >= 0)
          std::thread([ms = run.stop_children_after_ms] {
            std::this_thread::sleep_for(std::chrono::milliseconds(ms));
            for (const pid_t child : childPids()) ::kill(child, SIGSTOP);
          }).detach();
        agg.emplace(
            *model,
            [&](const gradagg::ShardContext& c) {
              if (c.step == run.kill_self_at_step && c.rank == 0) ::kill(::getppid(), SIGKILL);
              if (c.step == run.stop_self_at_step && c.rank == 0) ::kill(::getppid(), SIGSTOP);
              if (c.step == run.kill_worker_once_at_step && c.rank == 1 && killed->exchange(1) == 0)
                ::raise(SIGKILL);
              if (c.step == run.throw_at_step && c.rank == 0)
                throw std::runtime_error("bad record on node " + std::to_string(run.node));
              if (run.drop_grads)
                for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
              if (c.step == run.kill_worker_in_backward_at_step && c.rank == 1)
                model->parameters()[0].register_hook(
                    [](const torch::Tensor&) { ::raise(SIGKILL); });
              static bool slowed = false;  // once per worker process
              if (run.slow_first_layer_ms > 0 && !slowed) {
                slowed = true;
                model->parameters()[0].register_hook([&run](const torch::Tensor&) {
                  std::this_thread::sleep_for(std::chrono::milliseconds(run.slow_first_layer_ms));
                });
              }
              const int contributors =
                  run.empty_from_global_rank >= 0 ? run.empty_from_global_rank : c.global_workers;
              if (c.step == run.all_empty_at_step || c.global_rank >= contributors)
                return gradagg::ShardResult{torch::Tensor(), 0, {}};
              const auto bounds = shardBounds(run.batch, contributors, run.unequal);
              int64_t b = bounds[c.global_rank], e = bounds[c.global_rank + 1];
              if (c.micro_steps > 1) {  // this worker's shard, cut in micro-batches
                const int64_t n = e - b;
                const int64_t mb = b + n * c.micro_step / c.micro_steps;
                e = b + n * (c.micro_step + 1) / c.micro_steps;
                b = mb;
              }
              auto loss = model->loss(model->forward(data.x.slice(0, b, e)), data.y.slice(0, b, e));
              if (c.step == run.nan_loss_at_step && c.rank == 0) loss = loss * std::nan("");
              if (run.reentrant_last_param)
                loss = loss + ReentrantHalfSum::apply(model->parameters().back());
              gradagg::ShardResult r{loss, e - b, {}};
              if (run.metrics_and_message)
                r.metrics = {{"rows", static_cast<double>(e - b)},
                             {"step", static_cast<double>(c.step)},
                             {"seen_node", c.message.at("node").item<double>()}};
              for (int i = 0; i < run.metric_names; ++i) r.metrics["m" + std::to_string(i)] = 1;
              return r;
            },
            o);
        for (int s = 0; s < run.steps; ++s) {
          sgd.zero_grad();
          gradagg::Message message;
          if (run.metrics_and_message) message.set("node", run.node);
          if (run.interrupt_after_ms >= 0 && s == run.interrupt_at_step) interruptLater();
          if (s == run.pause_before_step) std::this_thread::sleep_for(run.pause);
          const gradagg::StepReport& report = agg->step(message);
          result.metrics = report.metrics;
          result.worker0_metrics = report.workers[0].metrics;
          result.node_bytes = report.node_bytes;
          result.collectives = report.node_collectives;
          result.overlapped += report.node_overlapped;
          result.restarts = report.restarts;
          sgd.step();
          if (s == run.perturb_after_step) {
            torch::NoGradGuard no_grad;
            model->parameters()[0].add_(1e-3);
          }
        }
      },
      &result.what);
  // How many parameters ended with a sparse .grad (Embedding(sparse=true)).
  int sparse = 0;
  for (const auto& p : model->parameters()) sparse += p.grad().defined() && p.grad().is_sparse();
  if (sparse > 0) result.metrics["sparse_grads"] = sparse;
  for (auto& t : interrupters) t.join();
  if ((result.outcome == kNodeFailed || result.outcome == kInterrupted) && agg) {
    result.usable_after = agg->usable();
    result.children_after = static_cast<int>(childPids().size());
    result.retry = outcomeOf([&] { agg->step(); }, &result.retry_what);
  }
  result.params = paramsOf(*model);
  ::munmap(shared, sizeof(std::atomic<int>));
  return result;
}

std::vector<NodeResult> runNodes(std::vector<NodeRun> runs) {
  std::vector<std::pair<pid_t, int>> children;
  for (const NodeRun& run : runs) {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    const pid_t test = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      // A node dies with the test (e.g. killed by ctest's timeout), as workers do.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != test) ::_exit(1);
      ::close(fds[0]);
      std::this_thread::sleep_for(run.start_delay);
      const auto t0 = std::chrono::steady_clock::now();
      NodeResult result = trainNode(run);
      result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      struct rusage usage {};
      ::getrusage(RUSAGE_SELF, &usage);  // this process only, not the store server it forked
      result.max_rss_mib = usage.ru_maxrss / 1024;
      send(fds[1], result);
      ::_exit(0);
    }
    ::close(fds[1]);
    children.emplace_back(pid, fds[0]);
  }
  std::vector<NodeResult> results(runs.size());
  // Stalled nodes last: once the others have reported, they are killed.
  const auto stalls = [&](size_t i) {
    return runs[i].stop_self_at_step >= 0 || runs[i].stop_self_after_ms >= 0;
  };
  std::vector<size_t> order;
  for (size_t i = 0; i < runs.size(); ++i)
    if (!stalls(i)) order.push_back(i);
  for (size_t i = 0; i < runs.size(); ++i)
    if (stalls(i)) order.push_back(i);
  for (size_t i : order) {
    if (stalls(i)) ::kill(children[i].first, SIGKILL);
    results[i] = receive(children[i].second);
    ::close(children[i].second);
    int status = 0;
    ::waitpid(children[i].first, &status, 0);
    results[i].status = status;
  }
  return results;
}

int MultiNode::freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

std::vector<torch::Tensor> trainOneNode(int workers, const NodeRun& like) {
  NodeRun run = like;
  run.nodes = 1;
  run.node = 0;
  run.workers = workers;
  NodeResult result = trainNode(run);
  EXPECT_EQ(result.outcome, kOk) << result.what;
  return result.params;
}

}  // namespace gradagg_test
