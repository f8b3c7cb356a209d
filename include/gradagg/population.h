// Population mode: N forked workers, each training its own replica with its own
// optimizer and hyperparameters (population-based training on one machine).
// Every `publish_interval` steps each worker publishes its weights, score and
// hyperparameters into the shared segment, where any worker and the parent can
// read any member's latest complete snapshot without blocking the writer; then a
// policy decides, in each worker, whether it keeps training its own weights or
// replaces them with a peer's (exploit), and perturbs its hyperparameters after a
// copy (explore). Members run in lockstep at publish points, so a run is
// reproducible from (seed, rank, step) and can be checkpointed and resumed.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <gradagg/errors.h>
#include <gradagg/model.h>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace gradagg {

// Named hyperparameters of one member; the names are fixed at construction.
using Hyperparams = std::map<std::string, double>;

// A small deterministic generator (splitmix64). Each decision draws from one
// derived from (seed, rank, step, stream), so runs are reproducible and resumable.
class DecisionRng {
 public:
  explicit DecisionRng(std::uint64_t state) : state_(state) {}
  static DecisionRng derive(std::uint64_t seed, int rank, std::int64_t step, std::uint64_t stream);
  std::uint64_t next();
  double uniform();  // [0, 1), 53 bits
  int below(int n);  // uniform in [0, n), n > 0

 private:
  std::uint64_t state_;
};

// What a policy sees: the scores of every member at this publish point.
struct PolicyInput {
  int rank = 0;
  int workers = 1;
  std::int64_t step = 0;
  std::vector<double> scores;  // by rank
  bool higher_is_better = false;
};

// Decides whether member `rank` copies a peer: returns the donor's rank, or -1.
class Policy {
 public:
  using Fn = std::function<int(const PolicyInput&, DecisionRng&)>;
  static Policy none();
  // With probability p, a uniformly chosen other member.
  static Policy random(double p);
  // Members in the bottom `fraction` by score copy a random one of the top
  // `fraction` (count = max(1, round(fraction * N)), at most N / 2); ties by rank.
  static Policy truncation(double fraction = 0.2);
  // A random other member, copied when its score is strictly better.
  static Policy tournament();
  static Policy custom(std::string name, Fn fn);

  int chooseDonor(const PolicyInput& in, DecisionRng& rng) const { return fn_(in, rng); }
  const std::string& name() const noexcept { return name_; }

 private:
  Policy(std::string name, Fn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  std::string name_;
  Fn fn_;
};

// True when score a is strictly better than b.
inline bool scoreBetter(double a, double b, bool higher_is_better) {
  return higher_is_better ? a > b : a < b;
}

enum class Explore {
  kNone,      // keep the (copied) hyperparameters as they are
  kPerturb,   // multiply each by 0.8 or 1.2, chosen at random
  kResample,  // PopulationOptions::resample gives new values
};

// Perturbs (x0.8 or x1.2 each, in name order) with `rng`.
Hyperparams perturb(const Hyperparams& hp, DecisionRng& rng);

struct PopulationOptions {
  int workers = 4;                     // 1..kMaxWorkers
  std::int64_t publish_interval = 10;  // K: train steps per generation
  std::uint64_t seed = 0;
  bool higher_is_better = false;  // score: accuracy (true) or loss (false)
  Policy policy = Policy::none();
  std::int64_t ready_interval = 0;   // steps since a member's last copy before it may copy again
  bool copy_optimizer_state = true;  // needs optimizer_state_bytes > 0
  bool copy_hyperparams = true;
  Explore explore = Explore::kPerturb;
  std::function<Hyperparams(const Hyperparams&, DecisionRng&)> resample;  // for kResample
  // Bytes reserved per snapshot for the serialized optimizer state (torch::save);
  // 0: the optimizer state is neither published, copied nor checkpointed.
  std::size_t optimizer_state_bytes = std::size_t{1} << 20;
  std::string lineage_path;    // JSON Lines, one line per copy, appended by the parent
  std::string resume_from;     // a checkpoint() file: every member starts from it
  int threads_per_worker = 0;  // 0: max(1, cores / workers)
  // Each member keeps the memory its steps free (glibc malloc), as
  // Options::keep_worker_memory does for an Aggregator's workers.
  bool keep_worker_memory = true;
  std::chrono::milliseconds step_timeout{std::chrono::minutes(5)};  // per generation phase
  std::chrono::milliseconds shutdown_timeout{std::chrono::seconds(2)};
  // A member that dies during a generation is forked again, from its latest
  // complete snapshot (losing the steps since), up to this many times in the
  // population's life; 0: WorkerDied. Not at start-up.
  int max_restarts = 0;
  int max_read_retries = 100000;  // a snapshot read retried more often raises InternalError

  static constexpr int kMaxWorkers = 64;
  static constexpr int kMaxHyperparams = 16;
  void validate() const;  // InvalidArgument naming the field
};

// What the user's functions see, in the worker.
struct MemberContext {
  int rank = 0;
  int workers = 1;
  std::int64_t step = 0;  // steps this member trained so far
  const Hyperparams* hyperparams = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  DecisionRng* rng = nullptr;  // derived from (seed, rank, step)
};

struct PopulationFns {
  // Creates a member's optimizer over its replica's parameters (in the worker).
  std::function<std::unique_ptr<torch::optim::Optimizer>(torch::nn::Module&, const Hyperparams&)>
      make_optimizer;
  // Initial hyperparameters of each rank (in the parent, before fork).
  std::function<Hyperparams(int rank, DecisionRng&)> hyperparams;
  // One training step: forward, backward and ctx.optimizer->step().
  std::function<void(const MemberContext&)> train_step;
  // The member's score at a publish point (e.g. validation loss or accuracy).
  std::function<double(const MemberContext&)> score;
  // Optional: per-rank initial weights (in the worker; not used on resume).
  std::function<void(int rank, torch::nn::Module&, DecisionRng&)> init_weights;
  // Optional: applies hyperparameters to the optimizer after a copy and on
  // resume (LibTorch 1.13's optimizer load keeps the live options, and a
  // resumed optimizer is made from the checkpointed hyperparameters, so apply
  // every one the optimizer uses); default sets every param group's lr to hp["lr"].
  std::function<void(torch::optim::Optimizer&, const Hyperparams&)> apply_hyperparams;
};

// One copy made at a publish point (one lineage line).
struct CopyEvent {
  std::int64_t step = 0;
  int worker = 0;
  int donor = 0;
  std::uint64_t donor_version = 0;
  double score = 0;  // the worker's own score before the copy
  double donor_score = 0;
  Hyperparams before, after;
};

// A member's latest complete snapshot, read without blocking it.
struct MemberSnapshot {
  int rank = 0;
  std::uint64_t version = 0;  // 1, 2, ... per member, counts publishes
  std::int64_t step = 0;
  std::int64_t last_copy_step = -1;
  double score = 0;
  Hyperparams hyperparams;
  std::vector<at::Tensor> parameters;  // cloned, in named_parameters() order
  std::vector<at::Tensor> buffers;
  std::string optimizer_state;  // torch::save bytes, empty when not kept
};

class Population {
 public:
  // Maps the segment, forks options.workers members (each a copy of `model`)
  // and waits until each published its first snapshot. The model must outlive it.
  Population(torch::nn::Module& model, PopulationFns fns, PopulationOptions options = {});
  // The same for any ModelView (a Python model, gradagg's Python binding): each
  // member's replica is its copy of the view's tensors. make_optimizer and
  // init_weights then receive an empty module; they reach the model through
  // what they captured (in the member, that is the member's copy).
  Population(ModelView model, PopulationFns fns, PopulationOptions options = {});
  ~Population();
  Population(const Population&) = delete;
  Population& operator=(const Population&) = delete;

  // One generation: every member trains publish_interval steps and publishes;
  // then each decides and copies (exploit + explore). Returns the copies made.
  // Throws WorkerDied / StepTimeout / WorkerFailed; after them NotUsable.
  std::vector<CopyEvent> generation();

  // Any member's latest complete snapshot (also after a WorkerDied).
  MemberSnapshot snapshot(int rank) const;
  // The whole population (weights, optimizer states, hyperparameters, scores)
  // to `path`, written like a gradagg::Checkpoint (temporary file, fsync,
  // rename, CRC-64; gradagg/checkpoint.h); resume with
  // PopulationOptions::resume_from (a corrupt file is a CheckpointError).
  // Throws CheckpointError when it cannot be written; `path` is then untouched.
  void checkpoint(const std::string& path) const;

  void shutdown();
  bool usable() const noexcept;
  int restarts() const noexcept;  // members restarted so far (max_restarts)
  int workers() const noexcept;
  std::vector<std::string> hyperparamNames() const;
  std::vector<int> workerPids() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradagg
