// The Aggregator: forked workers compute gradients of their shards, the parent
// gets the full-batch mean gradient in its model's .grad, then steps its optimizer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <gradagg/message.h>
#include <gradagg/model.h>
#include <gradagg/options.h>
#include <gradagg/shard.h>
#include <gradagg/step_report.h>

namespace torch::nn {
class Module;
}

namespace gradagg {

class Aggregator {
 public:
  // Moves the model's parameters and buffers into a shared segment (the model
  // keeps its tensors, now viewing shared memory), then forks options.workers
  // workers and waits until they are ready. The model must outlive the Aggregator.
  // Throws InvalidArgument for a model it cannot serve (CUDA, sparse or
  // unsupported dtype parameters) or bad options.
  Aggregator(torch::nn::Module& model, ShardFn shard, Options options = {});
  // The same for any list of named parameters and buffers (gradagg/model.h):
  // a TorchScript module (gradagg/script.h), a Python module, your own list.
  // The tensors must outlive the Aggregator.
  Aggregator(ModelView model, ShardFn shard, Options options = {});
  // Stops and reaps the workers and gives the model its own memory back.
  ~Aggregator();
  Aggregator(Aggregator&&) noexcept;
  Aggregator& operator=(Aggregator&&) noexcept;
  Aggregator(const Aggregator&) = delete;
  Aggregator& operator=(const Aggregator&) = delete;

  // One step: every worker runs the shard function on the current parameters
  // and buffers, and each parameter's .grad becomes the weighted mean gradient
  // (undefined where no worker produced one). Call optimizer.step() after it.
  // On any error nothing is changed: not the parameters, not .grad, not the buffers.
  // The report is reused by the next step. Its step is the global step
  // (Options::start_step or the resumed checkpoint's, then one more each step
  // that went through). A Checkpoint::load into the model since the last step
  // sets the global step and position to the checkpoint's.
  const StepReport& step();
  // The same, with a message the shard functions read as ctx.message
  // (gradagg/message.h). A message that does not fit Options::message_bytes,
  // or a tensor that cannot travel, is an InvalidArgument before anything runs.
  const StepReport& step(const Message& message);
  // The same at a position of the data (ShardedBatches::steps(epoch)): the
  // shard functions read it as ctx.position, and ShardedBatches::batch gives
  // that batch, whatever the steps before. Positions go forward: one before
  // position() (a batch already trained, or one before the checkpoint this
  // run resumed from) is an InvalidArgument before anything runs.
  const StepReport& step(const BatchPosition& position);
  const StepReport& step(const BatchPosition& position, const Message& message);

  // Stops the workers and gives the parent its own threads and heap settings
  // back (Options::parent_threads, keep_parent_memory); idempotent. step()
  // afterwards throws NotUsable.
  void shutdown();

  bool usable() const noexcept;
  int workers() const noexcept;
  // The global step the next step() computes: Options::start_step plus the
  // steps that went through (skipped ones included).
  std::int64_t stepsDone() const noexcept;
  // Where the data goes on: after step(position), position.next(); after a
  // resume, the checkpoint's TrainingState::position; {0, 0} before either.
  // Save it with the step (TrainingState::position).
  BatchPosition position() const noexcept;
  // The options it runs with (a moved-from Aggregator: the defaults, workers()
  // is 0 and usable() false).
  const Options& options() const noexcept;
  // Intra-op threads each worker runs (Options::threads_per_worker, resolved).
  int threadsPerWorker() const;
  // The workers' process ids by rank (empty when not usable), e.g. for monitoring.
  std::vector<int> workerPids() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradagg
