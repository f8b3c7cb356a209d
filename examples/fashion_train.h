// Training the Fashion-MNIST classifier (Dense(hidden, relu) -> Dense(10),
// softmax cross-entropy) with gradagg workers, or in this one process for
// comparison. Torch-free interface: fashion_mnist.cpp (the command line) and the
// tests call train(); fashion_train.cpp is the code to read and copy.
//
// The data: gradagg::data::ShardedBatches (gradagg/data.h) over the training
// set (fashion_data.h), with a global batch of G = workers * batch (workers of
// every node). Epoch e visits the samples in DistributedSampler's order,
// randperm(n) seeded with seed + e; each step takes the next G samples, each
// worker its contiguous part (batch samples, or fewer in the last step of an
// epoch, where some may have none and return 0 samples). Single-process mode
// (`single`) takes the same G samples in one batch (global_batch), so both
// compute the same mean gradient of the same samples. The shard function
// depends only on (global rank, step) and read-only data: steps are
// deterministic and a resumed run repeats an uninterrupted one.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <gradagg/options.h>

#include "idx.h"

namespace fashion {

enum class OptimizerKind { kAdam, kSgd };

struct TrainConfig {
  std::string data_dir = idx::kDebianFashionMnistDir;
  int workers = 2;  // gradagg workers; with `single`, only sizes the global batch
  int epochs = 5;   // train until this many epochs are done (counting resumed ones)
  int batch = 32;   // samples per worker per step
  double lr = 1e-3;
  OptimizerKind optimizer = OptimizerKind::kAdam;
  std::uint64_t seed = 1;  // initial weights and the data order
  int hidden = 64;
  std::int64_t limit = 0;   // use the first `limit` training samples; 0: all
  bool single = false;      // train in this process (batch workers * batch), no gradagg
  int step_timeout_s = 60;  // gradagg's deadline for a step (Options::step_timeout)
  int threads = 0;          // intra-op threads per worker (or of the one process); 0: default
  bool prefetch = false;    // load a worker's next batch on a loader thread (ShardedBatchesOptions)
  // Several machines, each with `workers` workers: the data split counts
  // workers * nodes.nodes in all (every node the same count) and worker r of
  // node k is global worker k * workers + r. Every node evaluates and prints.
  gradagg::NodeOptions nodes;

  std::string
      checkpoint;  // written at each epoch end, every `checkpoint_every` steps and when stopping
  std::int64_t checkpoint_every = 0;  // steps; 0: only at epoch ends and when stopping
  std::string resume;                 // checkpoint to continue from
  std::int64_t stop_after = 0;        // stop once this many steps (in all) are done; 0: never
};

// A snapshot after each step, for a progress display.
struct StepProgress {
  int epoch = 0;  // 0-based
  int epochs = 0;
  std::int64_t step_in_epoch = 0;  // steps done in this epoch (1 after its first)
  std::int64_t steps_per_epoch = 0;
  std::int64_t step = 0;  // steps done in all
  std::int64_t total_steps = 0;
  double loss = 0;           // this step's mean training loss
  double epoch_loss = 0;     // mean training loss of the epoch so far
  double samples_per_s = 0;  // training throughput of the epoch so far
  double eta_s = 0;          // estimated time to the end of the run
};

struct EpochResult {
  int epoch = 0;              // 0-based
  double train_loss = 0;      // mean over the epoch's training samples
  double train_accuracy = 0;  // of the training samples, as the model was at their step
  double test_loss = 0;       // mean over the test set, after the epoch
  double test_accuracy = 0;
  double train_seconds = 0;  // the steps only (no evaluation)
  double epoch_seconds = 0;  // steps and evaluation
  double samples_per_s = 0;  // training samples / train_seconds
  std::int64_t samples = 0;  // training samples seen in the epoch
};

struct Parameter {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<float> values;
};

struct TrainResult {
  std::vector<EpochResult> epochs;    // the epochs finished in this call
  std::int64_t steps = 0;             // steps done in all, resumed ones included
  bool stopped = false;               // stopped early (stop_after or should_stop)
  std::vector<Parameter> parameters;  // the final model
  std::int64_t train_samples = 0, test_samples = 0;
};

struct TrainCallbacks {
  std::function<void(const StepProgress&)> on_step;
  std::function<void(const EpochResult&)> on_epoch;
  // Polled after each step (e.g. a SIGINT flag): true stops, after a checkpoint.
  std::function<bool()> should_stop;
  // Said once, before the first step (data sizes, resume point).
  std::function<void(const std::string&)> on_info;
  // Runs each checkpoint save it is given (e.g. with stop signals held, so
  // that a second Ctrl-C cannot cut a save short); unset: the save just runs.
  std::function<void(const std::function<void()>& save)> around_save;
};

// Loads the data, trains, evaluates after every epoch. Checkpoints with
// gradagg::Checkpoint (node 0 writes; a resume is checked against the run's
// settings, and across nodes every node must resume from the same file and
// share the settings, epochs and data). Throws idx::Error for missing or bad
// data, std::invalid_argument for a bad configuration, gradagg::CheckpointError
// for a checkpoint that cannot be written or used, gradagg errors from the
// workers and nodes. After an error nothing is saved: the last checkpoint stays.
TrainResult train(const TrainConfig& config, const TrainCallbacks& callbacks = {});

const char* optimizerName(OptimizerKind kind);

}  // namespace fashion
