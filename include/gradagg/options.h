// Options of an Aggregator: plain data with defaults, validated once at construction.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include <gradagg/errors.h>

namespace gradagg {

// How the worker gradients are combined.
enum class Weighting {
  // w_i = n_i / sum_j n_j, with n_i the sample count the shard function reports.
  // When every shard's loss is a mean over its samples, this is exactly the
  // full-batch mean gradient, however unequal the shards are.
  kBySamples,
  // w_i = 1 / N, whatever the sample counts: what PyTorch DDP does.
  kEqual,
};

// What the parent's buffers (BatchNorm running statistics, ...) become after a step.
// Workers always start a step from the parent's buffers.
enum class BufferSync {
  kFromRank0,   // worker 0's updated buffers replace the parent's (DDP's rule)
  kMean,        // floating-point buffers: mean over workers with the step's weights;
                // other dtypes (e.g. num_batches_tracked) from worker 0
  kKeepParent,  // workers' updates are discarded; the parent's buffers stay as they are
};

// What float32 gradients travel as between nodes.
enum class Compression {
  kNone,      // as they are
  kBFloat16,  // bf16 on the wire (half the bytes), summed in float32 and rounded to
              // bf16 once per addition; the status (counts, flags) stays exact in
              // a second, small collective. Float64 gradients are never compressed.
};

// Several machines (nodes): inside each, workers reduce through shared memory;
// across them the node parents allreduce with LibTorch's c10d ProcessGroupGloo.
// A single-node run (nodes == 1) needs none of this and pays nothing for it.
struct NodeOptions {
  int nodes = 1;      // GRADAGG_NNODES
  int node_rank = 0;  // GRADAGG_NODE_RANK, 0..nodes-1
  // Rendezvous: a c10d TCPStore served by node 0 at master_addr:master_port
  // (MASTER_ADDR, MASTER_PORT as torchrun names them), or a c10d FileStore at
  // store_path on a file system every node sees (GRADAGG_STORE_PATH), used when set.
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string store_path;
  // The TCPStore at master_addr:master_port is served by someone else (torchrun's
  // agent with its static rendezvous: TORCHELASTIC_USE_AGENT_STORE=True), so
  // node 0 connects to it like every other node instead of serving it.
  bool external_store = false;
  // The store's keys are under this prefix; a launcher's restart gets its own
  // ("gradagg/attempt_<TORCHELASTIC_RESTART_COUNT>").
  std::string store_prefix = "gradagg";
  // The job token (GRADAGG_JOB_TOKEN): a secret every node of the job is given.
  // With it the nodes prove it to each other (HMAC-SHA256 challenges through
  // the store) before anything else crosses, and keep every other key under a
  // name derived from it: a process without it can neither join nor read the
  // model or the Gloo addresses from the store, and a node with another token
  // is refused at once. Without it node 0 serving on a non-loopback address
  // prints a warning (docs/multinode.md, "Security").
  std::string token;
  // Network interface Gloo binds to (GRADAGG_SOCKET_IFNAME, e.g. "eth0");
  // empty: the address this machine's hostname resolves to.
  std::string interface;
  // Deadline of the rendezvous and of every cross-node collective
  // (GRADAGG_NODE_TIMEOUT_MS): a dead node or a stalled network ends every
  // other node with NodeFailed within it. Like every timeout here, one over
  // 30 days is taken as 30 days.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  // Every this many steps, the nodes compare a checksum of their parameters
  // (GRADAGG_CHECKSUM_INTERVAL); 0 = never.
  int checksum_interval = 100;
  // Off by default, like DDP's fp16 compression hook (GRADAGG_COMPRESSION=bf16).
  Compression compression = Compression::kNone;
  // Buckets, as DDP's: the gradient crosses the nodes in buckets of about this
  // many bytes (GRADAGG_BUCKET_BYTES; DDP's bucket_cap_mb is 25), the first of
  // each dtype of about first_bucket_bytes (GRADAGG_FIRST_BUCKET_BYTES; DDP's
  // 1 MiB, so the first transfer starts early), filled in reverse registration
  // order, each within one dtype, closed at the first parameter that reaches
  // the size. With `overlap` (GRADAGG_OVERLAP=0 turns it
  // off) a bucket's allreduce starts as soon as every worker of this node has
  // produced its gradients and this node's sum of it is done, while backward
  // goes on for the earlier layers; without it the same buckets go after
  // backward. Either way the same bits (docs/multinode.md). A model that fits
  // one bucket per dtype crosses as one collective with the step's status.
  std::uint64_t bucket_bytes = 25ull << 20;
  std::uint64_t first_bucket_bytes = 1ull << 20;
  bool overlap = true;

  // What every node must agree on before a step runs. At the rendezvous the
  // nodes compare them (and Options::start_step); any difference is an
  // InvalidArgument on every node naming the field and what each node has,
  // before any state changes.
  //  - resume_identity: "" for a fresh start, else Checkpoint::identity() of
  //    the file this node resumed from (the same file on every node);
  //  - must_match: the application's settings that change the training
  //    (seed, data, batch, epochs, ...), as text.
  std::string resume_identity;
  std::map<std::string, std::string> must_match;

  // `defaults` overridden by whichever of the variables above are set, and by
  // the launchers' own, the explicit GRADAGG_* ones taking precedence:
  //  - torchrun --nnodes N --nproc-per-node 1: GROUP_WORLD_SIZE, GROUP_RANK (or
  //    NODE_RANK), MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE,
  //    TORCHELASTIC_RESTART_COUNT;
  //  - Slurm (srun, one task per node): SLURM_NNODES, SLURM_NODEID, and the
  //    first host of SLURM_JOB_NODELIST as master_addr (MASTER_ADDR wins).
  // A value that is not an integer where one is expected: InvalidArgument
  // naming the variable.
  static NodeOptions fromEnvironment(NodeOptions defaults);
  static NodeOptions fromEnvironment();
};

// What a step does when a worker's gradient (or loss) is NaN or infinite.
enum class NonFinitePolicy {
  kRaise,     // throw NonFiniteGradient naming the rank and the parameter
  kSkipStep,  // leave every .grad undefined (optimizer.step() then changes nothing),
              // report StepReport::skipped; like AMP's GradScaler
};

struct Options {
  // Worker processes forked at construction, 1..kMaxWorkers.
  int workers = 2;
  Weighting weighting = Weighting::kBySamples;
  BufferSync buffers = BufferSync::kFromRank0;
  // Intra-op threads in each worker; 0 means max(1, cores / workers), where
  // across nodes the workers of every node on the same machine and CPUs count
  // (give each node its own CPUs, e.g. with taskset, and only its own count).
  int threads_per_worker = 0;
  // Intra-op and BLAS threads of the parent while the Aggregator lives
  // (restored at shutdown). Inside step() the parent waits; between steps the
  // workers wait and the parent runs optimizer.step(). One thread by default:
  // after each parallel region of the parent, libgomp keeps its pool threads
  // spinning for milliseconds (GOMP_SPINCOUNT), on the cores the workers need
  // once step() is called (Adam, OpenBLAS, 2 cores: 670K parameters 7.5 ms a
  // step with one parent thread, 12.5 ms with two; docs/benchmark.md). kEveryCore
  // (every core this process may use) pays only where the optimizer step is
  // long (~5M parameters and more with Adam); 0 leaves the parent's setting alone.
  static constexpr int kEveryCore = -1;
  int parent_threads = 1;
  // The parent's heap keeps the memory its optimizer step frees for the next
  // one, as keep_worker_memory does for the workers (runtime/heap.h): Adam on
  // 5.8M parameters maps, faults in and unmaps 23 MB of temporaries every step
  // otherwise (147 ms instead of 10.7 on one thread). Restored to the
  // thresholds the process started with (GLIBC_TUNABLES', else glibc's 128 KiB)
  // when the last Aggregator ends; false: the parent's heap is never changed.
  bool keep_parent_memory = true;
  // Each worker keeps the memory its steps free for its next step: glibc's
  // malloc serves chunks up to 32 MiB from the heap and does not give the heap
  // back to the kernel (runtime/heap.h). Otherwise a step's large temporaries
  // may be mapped, faulted in and zeroed anew every step, depending on what
  // the parent had freed before the fork (a CNN's step ran 1.3-2x slower here:
  // docs/benchmark.md). Each worker then holds its peak heap until it exits.
  // false: glibc's defaults, as inherited at fork.
  bool keep_worker_memory = true;
  // Deadline for every worker to finish a step (and to start up); a late worker
  // raises StepTimeout naming its rank. Over 30 days: 30 days.
  std::chrono::milliseconds step_timeout{std::chrono::minutes(5)};
  // How long shutdown waits for workers to exit before it kills them.
  std::chrono::milliseconds shutdown_timeout{std::chrono::seconds(2)};

  // Gradient accumulation: each step, every worker runs its shard function this
  // many times (ShardContext::micro_step = 0..accumulation_steps-1) and their
  // gradients add up in its slot before the one reduction: the step's .grad is
  // the mean gradient over every micro-batch of every worker (weighted by
  // samples, or with kEqual the mean of each worker's micro-batch mean), as one
  // process computes it on all those samples at once. Memory stays one slot per
  // worker; the handshake and the reduction happen once per step. 1: off.
  int accumulation_steps = 1;

  NonFinitePolicy non_finite = NonFinitePolicy::kRaise;
  // With kSkipStep: more consecutive skipped steps than this raise NonFiniteGradient.
  int max_consecutive_skips = 10;
  // When a worker dies or misses the deadline during a step, stop all workers,
  // fork a fresh group and redo the step, up to this many times in the
  // aggregator's life (torchrun restarts the whole group the same way). 0: raise.
  // A restarted worker starts from the parent's state: keep per-worker state in
  // the shard function derivable from (rank, step) if you use this.
  int max_restarts = 0;
  NodeOptions nodes;
  // Each step, before the shard function, every worker seeds LibTorch's default
  // generator with workerSeed(seed, global rank, step) (gradagg/shard.h):
  // dropout and other random ops draw different numbers in different workers
  // (not the copy every fork inherits), and a redone or restarted step draws
  // the same ones. false: leave the generator alone (each worker continues the
  // stream it forked with).
  bool seed_workers = true;
  // The run's seed. Unset (the default): the parent's torch seed when the
  // Aggregator is made (the default CPU generator's current_seed(): what
  // torch::manual_seed / torch.manual_seed set last, and what a checkpoint's
  // load restores), so a program's --seed changes the workers' dropout as it
  // does in one process. Across nodes every node must have the same (compared
  // at the rendezvous).
  std::optional<std::uint64_t> seed;
  // Each step, compare model.parameters() with the list at construction, so a
  // replaced submodule or a new parameter is an InvalidArgument instead of a
  // silently untrained model. LibTorch builds that list anew (a few small
  // allocations per parameter); false makes step() allocation-free.
  bool check_parameter_list = true;

  // The global step of the first step() (ShardContext::step, StepReport::step,
  // the workers' seeds): the steps done before this run. A resumed run gives
  // the checkpoint's TrainingState::step, so it draws the dropout masks and
  // reads the batches of the run that was never stopped, bit for bit. Across
  // nodes every node must give the same (compared at the rendezvous). Left at
  // 0 after Checkpoint::load into the model, the Aggregator takes the
  // checkpoint's step (and data position); another value than the
  // checkpoint's is an InvalidArgument.
  std::int64_t start_step = 0;
  // Room in the segment for the message of a step (step(message),
  // gradagg/message.h): its tensors' bytes, each rounded up to 64, and 152 bytes per entry. A
  // message that does not fit is an InvalidArgument before anything runs.
  std::uint64_t message_bytes = 64 << 10;

  static constexpr int kMaxWorkers = 256;

  // Throws InvalidArgument naming the first field that is out of range.
  void validate() const;
  // threads_per_worker with 0 resolved against the cores this process may use:
  // max(1, cores / workers_on_these_cores), where the workers on these cores are
  // this node's and, across nodes, those of other nodes on the same machine
  // and CPUs (the Aggregator finds them at the rendezvous).
  int resolvedThreadsPerWorker(int workers_on_these_cores) const;
  int resolvedThreadsPerWorker() const { return resolvedThreadsPerWorker(workers); }
};

// Cores this process may run on: its affinity mask (sched_getaffinity), fewer
// where a cgroup's CPU quota allows less (rounded up); at least 1.
int availableCores();

}  // namespace gradagg
