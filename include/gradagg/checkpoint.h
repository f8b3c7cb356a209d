// Checkpoint: a training's state in one file — the model's parameters and
// buffers, the optimizer's state and an LR scheduler's, the position (steps
// done, the data's next batch), LibTorch's default CPU generator, the
// application's metadata and the settings a resume must share — written so
// that a crash, a full disk or a kill at any moment leaves either the previous
// checkpoint or the new one, never a mix:
//
//   1. save() serialises the content in memory (a torch::serialize archive)
//      and returns: training goes on while
//   2. a writer thread writes it to "<path>.tmp-<pid>.<n>" with a header that
//      holds its length and a CRC-64 of it, fsyncs and closes the file,
//   3. renames it over <path> and fsyncs the directory.
// A save waits for the write before it; wait() waits for the last one. A failed
// write (ENOSPC, EFBIG, EIO, ...) is a CheckpointError naming the file and the
// step, thrown by the next save(), wait() or load(); the temporary file is
// removed and <path> is untouched. The last copy of a Checkpoint waits for its
// write when destroyed (and prints a failure to stderr: call wait() to get it).
//
// Loading reads the whole file, checks the header and the CRC before LibTorch
// parses anything (a corrupt or truncated file is a CheckpointError naming it,
// never garbage), compares the saved settings with the caller's, then copies
// every parameter and buffer by name (a missing one or a shape/dtype mismatch
// is a CheckpointError naming it) and loads the optimizer.
//
// The constructor checks that the file can be written (its directory exists
// and accepts a new file), so a bad path fails when the run starts, not at its
// first save. It also takes the path's CheckpointLock and keeps it while it (or
// a copy) lives: a second run writing the same path is refused when it starts.
// Across nodes every node holds the same bits: let node 0 save (the
// examples do), let every node load the same file, and give
// NodeOptions::resume_identity = identity() so the nodes check at the
// rendezvous that they all resumed from it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <gradagg/errors.h>
#include <gradagg/model.h>
#include <gradagg/shard.h>

namespace torch::optim {
class Optimizer;
class LRScheduler;
}  // namespace torch::optim

namespace gradagg {

namespace detail {
class CheckpointWriter;
}

// Where a run is and what it was started with.
struct TrainingState {
  std::int64_t step = 0;  // optimizer steps done in all
  // The application's own values (epoch sums, a data cursor, ...), as text:
  // format numbers with fmt's "{}" (shortest round trip) and read them back exactly.
  std::map<std::string, std::string> metadata;
  // What a resume must share with the run that saved (seed, batch, data, ...):
  // load() compares them with the caller's and names the first that differs.
  std::map<std::string, std::string> settings;
  // Set by load(): the identity() of the file it read (NodeOptions::resume_identity),
  // without reading the file again. save() ignores it.
  std::string identity;
  // The data's next batch (Aggregator::position()): the loop goes on with
  // ShardedBatches::steps(epoch, position) for epoch = position.epoch on. A
  // checkpoint taken at an epoch's last step holds {epoch, steps_per_epoch}:
  // the resumed loop runs what followed that epoch (its scheduler step) first.
  BatchPosition position;
};

// A checkpoint that cannot be written or read, or does not fit: path() names
// the file; what failed and the operating system's reason are in what().
class CheckpointError : public FileError {
 public:
  using FileError::FileError;
};

// An advisory lock on a checkpoint path for as long as a run writes it:
// flock(LOCK_EX | LOCK_NB) on "<path>.lock" (mode 0600), which holds the
// holder's pid and host. The kernel releases it when the holder exits, also
// after kill -9; a clean release removes the file, one left by a killed holder
// is taken over. In one process, locks of one path share the one flock (a
// second Checkpoint of the path is not refused); a forked child (a worker)
// does not hold it. Where the file system has no locks (ENOLCK, EOPNOTSUPP)
// nothing is locked.
class CheckpointLock {
 public:
  // Throws CheckpointError naming `checkpoint_path` and, when another live
  // process holds the lock, that process ("... is being written by process
  // 1234 (its lock <path>.lock); ..."); also when "<path>.lock" exists and is
  // not a lock file (a checkpoint, say): it is never overwritten.
  explicit CheckpointLock(const std::string& checkpoint_path);
  CheckpointLock(CheckpointLock&& other) noexcept;
  CheckpointLock& operator=(CheckpointLock&& other) noexcept;
  CheckpointLock(const CheckpointLock&) = delete;
  CheckpointLock& operator=(const CheckpointLock&) = delete;
  ~CheckpointLock();

  // "<checkpoint_path>.lock".
  static std::string lockPathOf(const std::string& checkpoint_path);

 private:
  void release() noexcept;
  std::uint64_t key_ = 0;  // this process's entry for the lock file (0: none)
  int owner_ = 0;          // the pid that took it: a forked copy releases nothing
};

class Checkpoint {
 public:
  enum class Access {
    kReadWrite,  // checked now: the file can be written
    kReadOnly,   // only load() and identity(): save() throws CheckpointError
  };
  // With kReadWrite, throws CheckpointError when `path` is empty, is a
  // directory, or its directory is missing or does not accept a new file (a
  // probe file is created and removed), or another process holds its
  // CheckpointLock (named). Nothing is read yet.
  explicit Checkpoint(std::string path, Access access = Access::kReadWrite);

  const std::string& path() const noexcept { return path_; }
  bool exists() const;

  // Writes model, optimizer and scheduler (either may be null: not saved),
  // state and the default CPU generator's state as described at the top: the
  // content is copied before it returns, the file is written by the writer
  // thread. Throws CheckpointError (also the previous write's failure, before
  // anything of this one is done).
  void save(const ModelView& model, const torch::optim::Optimizer* optimizer,
            const TrainingState& state, const torch::optim::LRScheduler* scheduler = nullptr) const;
  void save(torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
            const TrainingState& state, const torch::optim::LRScheduler* scheduler = nullptr) const;
  // Waits until the last save's file is in place; throws its CheckpointError.
  void wait() const;

  // Verifies and loads into model and optimizer (may be null: not loaded) and
  // restores the default CPU generator. `settings` must equal the saved ones
  // (a key missing on either side differs too). Nothing is changed when it
  // throws CheckpointError, except that the optimizer may be partly loaded
  // when its own state does not fit it.
  // A scheduler (may be null) gets its step count back; the learning rates are
  // the optimizer's. An Aggregator of `model` goes on from state.step and
  // state.position (Options::start_step).
  TrainingState load(const ModelView& model, torch::optim::Optimizer* optimizer,
                     const std::map<std::string, std::string>& settings,
                     torch::optim::LRScheduler* scheduler = nullptr) const;
  TrainingState load(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     const std::map<std::string, std::string>& settings,
                     torch::optim::LRScheduler* scheduler = nullptr) const;

  // The identity of the file as it is on disk: its content's CRC-64 and length
  // in hex ("" when there is no file). Verifies the file like load() does.
  std::string identity() const;

 private:
  std::string path_;
  Access access_;
  std::shared_ptr<const CheckpointLock> lock_;        // with kReadWrite; shared by copies
  std::shared_ptr<detail::CheckpointWriter> writer_;  // the write in flight; shared by copies
};

}  // namespace gradagg
