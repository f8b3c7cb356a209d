// The references gradagg is measured against, each in processes of its own:
//  - single: one process as users run it, a fresh one (this program started
//    again with --one-process): glibc's default heap, --threads intra-op and
//    BLAS threads, nothing inherited from the bench's own history;
//  - single-kept: the same with the heap settings gradagg's workers use
//    (Options::keep_worker_memory), so that a gain from the allocator is never
//    reported as a gain from parallelism;
//  - ceiling: --workers independent processes side by side, forked like
//    gradagg's workers, each with a worker's threads and heap settings, each
//    training its own copy of the model on its share of the batch with no
//    communication at all: what any data-parallel split can reach here.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gradagg/blas.h>

#include "forked_peers.h"
#include "modes.h"
#include "runtime/heap.h"

namespace gradagg::bench {

namespace {

constexpr auto kCeilingTimeout = std::chrono::minutes(10);

// Runs this program again as `--one-process heap` on the one model and returns
// the row it prints (one JSON line on its stdout).
Row runFresh(const ModelSpec& spec, const Config& cfg, const char* heap) {
  std::vector<std::string> args = {"/proc/self/exe",
                                   "--one-process",
                                   heap,
                                   "-m",
                                   spec.name,
                                   "-b",
                                   std::to_string(spec.batch),
                                   "-s",
                                   std::to_string(cfg.steps),
                                   "--warmup",
                                   std::to_string(cfg.warmup),
                                   "-t",
                                   std::to_string(cfg.threads),
                                   "--optimizer",
                                   cfg.optimizer};
  int out[2];
  if (::pipe(out) != 0) throw std::runtime_error("gradagg-bench: pipe failed");
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("gradagg-bench: fork failed");
  if (pid == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  ::close(out[1]);
  std::string text;
  char buffer[4096];
  for (ssize_t got; (got = ::read(out[0], buffer, sizeof buffer)) != 0;) {
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) break;
    text.append(buffer, static_cast<std::size_t>(got));
  }
  ::close(out[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || text.empty())
    throw std::runtime_error(std::string("gradagg-bench: the ") + heap +
                             "-heap one-process run failed");
  return rowFromJson(text.substr(0, text.find('\n')));
}

// What each ceiling process leaves for the parent: its median step.
struct CeilingRecord {
  std::atomic<int> ready;  // processes set up; they start together
  double median_ms[Options::kMaxWorkers];
  double compute_ms[Options::kMaxWorkers];
};

void runAlone(const ModelSpec& spec, const Data& data, const Config& cfg, int rank,
              CeilingRecord* rec) {
  pinTo(cfg.placement, rank, cfg.workers);
  detail::keepFreedMemory();
  const int threads = peerThreads(cfg);
  at::set_num_threads(threads);
  setBlasThreads(threads);
  const Shard sh = shardOf(spec.batch, rank, cfg.workers);
  const torch::Tensor xs = data.x.slice(0, sh.begin, sh.end).clone();
  const torch::Tensor ys = data.y.slice(0, sh.begin, sh.end).clone();
  const AloneTimes times = trainAlone(spec, xs, ys, cfg, [&] {
    rec->ready.fetch_add(1);  // set up: start together
    while (rec->ready.load() < cfg.workers) std::this_thread::yield();
  });
  rec->median_ms[rank] = median(times.total);
  rec->compute_ms[rank] = median(times.compute);
}

}  // namespace

Row runSingleAsUsersRunIt(const ModelSpec& spec, const Data&, const Config& cfg) {
  Row row = runFresh(spec, cfg, "default");
  row.mode = "single";
  return row;
}

Row runSingleKeptHeap(const ModelSpec& spec, const Data&, const Config& cfg) {
  Row row = runFresh(spec, cfg, "kept");
  row.mode = "single-kept";
  return row;
}

Row runOneProcess(const ModelSpec& spec, const Data& data, const Config& cfg,
                  const std::string& heap) {
  if (heap == "kept") detail::keepFreedMemory();
  setBlasThreads(cfg.threads);
  return runSingle(spec, data, cfg);
}

Row runCeiling(const ModelSpec& spec, const Data& data, const Config& cfg) {
  if (cfg.workers > Options::kMaxWorkers) throw std::invalid_argument("ceiling: too many workers");
  detail::Segment shared;
  auto* rec = new (sharedMapping(shared, sizeof(CeilingRecord))) CeilingRecord{};
  ForkedPeers peers;
  peers.spawn(cfg.workers, [&](int rank) {
    runAlone(spec, data, cfg, rank, rec);
    return 0;
  });
  peers.join(kCeilingTimeout);
  // The slowest process bounds any split's step; no process waits for another.
  const double* slowest = std::max_element(rec->median_ms, rec->median_ms + cfg.workers);
  Row row = makeRow(spec, "ceiling", cfg.workers, peerThreads(cfg), cfg.steps);
  row.ms_per_step = *slowest;
  row.p90_ms = *slowest;
  row.extra["compute_ms"] = rec->compute_ms[slowest - rec->median_ms];
  row.extra["fastest_ms"] = *std::min_element(rec->median_ms, rec->median_ms + cfg.workers);
  return row;
}

}  // namespace gradagg::bench
