// Checkpoint (include/gradagg/checkpoint.h): what goes into the payload of a
// durable file (checkpoint/durable_file.h): a torch::serialize archive of
//   format "gradagg-checkpoint/1", step, rng, names (parameter and buffer
//   names, '\n'-joined), p<i> / b<i> (their tensors), optimizer (an archive),
//   metadata, settings (length-prefixed key/value text), and since the data
//   position and schedulers: epoch, batch_index (TrainingState::position; a
//   file without them reads {0, 0}), learning_rates (each parameter group's,
//   with the optimizer), scheduler_steps (an LR scheduler's step count, when
//   one was saved).
// The payload is made on the caller's thread; the writer thread
// (checkpoint/checkpoint_writer.h) puts it in place.
#include <gradagg/checkpoint.h>

#include <sys/stat.h>

#include <limits>
#include <mutex>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/ivalue.h>
#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <torch/optim/schedulers/lr_scheduler.h>

#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/durable_file.h"
#include "model/model_binding.h"
#include "model/resumed.h"
#include "runtime/text_map.h"

namespace gradagg {

namespace {

constexpr const char* kFormat = detail::kCheckpointFormat;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw CheckpointError(fmt::format("gradagg: checkpoint {}: {}", path, what), path);
}

std::map<std::string, std::string> decode(const std::string& s, const std::string& path) {
  auto m = detail::decodeTextMap(s);
  if (!m) fail(path, "its metadata are malformed");
  return *m;
}

// Checkpoint::identity(): the payload's CRC-64 and length, in hex.
std::string identityOf(std::uint64_t crc, std::size_t bytes) {
  return fmt::format("{:016x}-{:x}", crc, bytes);
}

// Each parameter group's learning rate: LibTorch 1.13 saves a group's options
// but its load() keeps the optimizer's own, so a rate a scheduler (or the
// program) set would come back as the initial one. Empty where an optimizer
// has no learning rate.
std::vector<double> learningRates(const torch::optim::Optimizer& optimizer) {
  std::vector<double> rates;
  try {
    for (const auto& group : optimizer.param_groups()) rates.push_back(group.options().get_lr());
  } catch (const c10::Error&) {
    rates.clear();
  }
  return rates;
}

// An LR scheduler's state is its step count (the rates live in the optimizer's
// parameter groups, which the optimizer's archive holds); LibTorch keeps it
// protected, so it is reached as a member of a derived class.
struct SchedulerSteps : torch::optim::LRScheduler {
  static unsigned& of(torch::optim::LRScheduler& s) { return s.*(&SchedulerSteps::step_count_); }
  static unsigned of(const torch::optim::LRScheduler& s) {
    return s.*(&SchedulerSteps::step_count_);
  }
};

std::string joinNames(const ModelView& model) {
  std::string names;
  for (const auto& p : model.parameters) names += "p " + p.name + "\n";
  for (const auto& b : model.buffers) names += "b " + b.name + "\n";
  return names;
}

}  // namespace

Checkpoint::Checkpoint(std::string path, Access access)
    : path_(std::move(path)),
      access_(access),
      writer_(std::make_shared<detail::CheckpointWriter>()) {
  if (access_ == Access::kReadWrite) {
    detail::checkWritable(path_);
    lock_ = std::make_shared<const CheckpointLock>(path_);
  }
}

void Checkpoint::wait() const {
  if (writer_) writer_->wait();
}

bool Checkpoint::exists() const {
  wait();
  struct stat st {};
  return ::stat(path_.c_str(), &st) == 0;
}

void Checkpoint::save(const ModelView& model, const torch::optim::Optimizer* optimizer,
                      const TrainingState& state,
                      const torch::optim::LRScheduler* scheduler) const {
  if (access_ == Access::kReadOnly) fail(path_, "was opened read-only (Access::kReadOnly)");
  if (!writer_) fail(path_, "is a moved-from Checkpoint");
  writer_->wait();  // the previous write's failure first, before anything of this one
  std::string payload;
  try {
    torch::serialize::OutputArchive archive;
    archive.write("format", c10::IValue(std::string(kFormat)));
    archive.write("step", c10::IValue(state.step));
    archive.write("epoch", c10::IValue(state.position.epoch));
    archive.write("batch_index", c10::IValue(state.position.index));
    if (scheduler != nullptr)
      archive.write("scheduler_steps",
                    c10::IValue(static_cast<std::int64_t>(SchedulerSteps::of(*scheduler))));
    archive.write("names", c10::IValue(joinNames(model)));
    for (std::size_t i = 0; i < model.parameters.size(); ++i)
      archive.write(fmt::format("p{}", i), model.parameters[i].tensor.detach());
    for (std::size_t i = 0; i < model.buffers.size(); ++i)
      archive.write(fmt::format("b{}", i), model.buffers[i].tensor.detach(), /*is_buffer=*/true);
    if (optimizer != nullptr) {
      torch::serialize::OutputArchive nested;
      optimizer->save(nested);
      archive.write("optimizer", nested);
      archive.write("learning_rates", c10::IValue(learningRates(*optimizer)));
    }
    archive.write("metadata", c10::IValue(detail::encodeTextMap(state.metadata)));
    archive.write("settings", c10::IValue(detail::encodeTextMap(state.settings)));
    {
      auto generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      archive.write("rng", generator.get_state());
    }
    archive.save_to([&](const void* data, std::size_t n) {
      payload.append(static_cast<const char*>(data), n);
      return n;
    });
  } catch (const c10::Error& e) {
    fail(path_, fmt::format("serialising failed: {}", e.what_without_backtrace()));
  }
  writer_->start(path_, std::move(payload), state.step);
}

void Checkpoint::save(torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                      const TrainingState& state,
                      const torch::optim::LRScheduler* scheduler) const {
  save(viewOf(model), &optimizer, state, scheduler);
}

namespace {

// What a checkpoint holds besides the optimizer state, as read (nothing applied yet).
struct Saved {
  std::vector<at::Tensor> params, buffers;
  at::Tensor rng;
};

// Parses the archive: its format, settings, metadata, step, the model's names
// (they must be `model`'s), every tensor and the generator's state.
Saved readSaved(torch::serialize::InputArchive& archive, const std::string& payload,
                const ModelView& model, TrainingState& state, const std::string& path) {
  Saved saved;
  try {
    archive.load_from(payload.data(), payload.size());
    c10::IValue v;
    // Population::checkpoint writes "gradagg-population/1"; older ones no format.
    c10::IValue hp_names;
    const bool has_format = archive.try_read("format", v);
    if ((has_format && v.isString() && v.toStringRef() == detail::kPopulationFormat) ||
        (!has_format && archive.try_read("hp_names", hp_names)))
      fail(path, fmt::format("is a population checkpoint ({}, Population::checkpoint), not a {} "
                             "file: give it to PopulationOptions::resume_from",
                             detail::kPopulationFormat, kFormat));
    if (!has_format || !v.isString() || v.toStringRef() != kFormat)
      fail(path, fmt::format("is not a {} file", kFormat));
    archive.read("settings", v);
    state.settings = decode(v.toStringRef(), path);
    archive.read("metadata", v);
    state.metadata = decode(v.toStringRef(), path);
    archive.read("step", v);
    state.step = v.toInt();
    if (archive.try_read("epoch", v)) state.position.epoch = v.toInt();
    if (archive.try_read("batch_index", v)) state.position.index = v.toInt();
    archive.read("names", v);
    if (v.toStringRef() != joinNames(model)) {
      // Name the first parameter or buffer that differs.
      std::istringstream theirs(v.toStringRef()), mine(joinNames(model));
      std::string a, b;
      while (std::getline(theirs, a) && std::getline(mine, b) && a == b) {
      }
      fail(path, fmt::format("holds a different model: '{}' where this model has '{}' "
                             "(p: parameter, b: buffer, in order)",
                             a, b));
    }
    saved.params.resize(model.parameters.size());
    for (std::size_t i = 0; i < saved.params.size(); ++i)
      archive.read(fmt::format("p{}", i), saved.params[i]);
    saved.buffers.resize(model.buffers.size());
    for (std::size_t i = 0; i < saved.buffers.size(); ++i)
      archive.read(fmt::format("b{}", i), saved.buffers[i], /*is_buffer=*/true);
    archive.read("rng", saved.rng);
  } catch (const c10::Error& e) {
    fail(path, fmt::format("cannot be parsed: {}", e.what_without_backtrace()));
  }
  return saved;
}

// The saved settings must be the caller's, key for key.
void checkSettings(const std::map<std::string, std::string>& theirs,
                   const std::map<std::string, std::string>& mine, const std::string& path) {
  for (const auto& [key, value] : mine) {
    const auto it = theirs.find(key);
    if (it == theirs.end() || it->second != value)
      fail(path, fmt::format("was written with {} = {}, this run has {} = {}; resume with the "
                             "settings of the run that saved it",
                             key, it == theirs.end() ? "(not set)" : it->second, key, value));
  }
  for (const auto& [key, value] : theirs)
    if (mine.count(key) == 0)
      fail(path,
           fmt::format("was written with {} = {}, this run does not set {}", key, value, key));
}

// Every saved tensor must have its model tensor's shape and dtype.
void checkShapes(const ModelView& model, const Saved& saved, const std::string& path) {
  auto check = [&](const NamedTensor& mine, const at::Tensor& theirs) {
    if (!theirs.sizes().equals(mine.tensor.sizes()) ||
        theirs.scalar_type() != mine.tensor.scalar_type())
      fail(path,
           fmt::format("'{}' is {} there, {} in this model", mine.name,
                       detail::describeShape(theirs.sizes(), theirs.scalar_type()),
                       detail::describeShape(mine.tensor.sizes(), mine.tensor.scalar_type())));
  };
  for (std::size_t i = 0; i < saved.params.size(); ++i) check(model.parameters[i], saved.params[i]);
  for (std::size_t i = 0; i < saved.buffers.size(); ++i) check(model.buffers[i], saved.buffers[i]);
}

// The saved generator state must be one the default CPU generator takes (its
// size, a seeded mt19937): tried on a generator of its own, before anything is set.
void checkGeneratorState(const at::Tensor& rng, const std::string& path) {
  try {
    at::detail::createCPUGenerator().set_state(rng);
  } catch (const c10::Error& e) {
    fail(path, fmt::format("holds a random generator state the CPU generator refuses: {}",
                           e.what_without_backtrace()));
  }
}

}  // namespace

TrainingState Checkpoint::load(const ModelView& model, torch::optim::Optimizer* optimizer,
                               const std::map<std::string, std::string>& settings,
                               torch::optim::LRScheduler* scheduler) const {
  wait();  // a save in flight first: this reads what it wrote (or throws why it could not)
  std::uint64_t crc = 0;
  const std::string payload = detail::readVerified(path_, &crc);  // names a missing file too
  torch::serialize::InputArchive archive;
  TrainingState state;
  state.identity = identityOf(crc, payload.size());
  const Saved saved = readSaved(archive, payload, model, state, path_);
  // Settings first, then every shape, the generator's state and the scheduler's
  // steps: nothing is changed before all fit.
  checkSettings(state.settings, settings, path_);
  checkShapes(model, saved, path_);
  checkGeneratorState(saved.rng, path_);
  std::int64_t scheduler_steps = 0;
  if (scheduler != nullptr) {
    c10::IValue v;
    if (!archive.try_read("scheduler_steps", v))
      fail(path_, "holds no scheduler state (it was saved without a scheduler)");
    if (!v.isInt() || v.toInt() < 0 || v.toInt() > std::numeric_limits<unsigned>::max())
      fail(path_, fmt::format("holds scheduler steps {}, not a count", c10::str(v)));
    scheduler_steps = v.toInt();
  }
  try {
    if (optimizer != nullptr) {
      torch::serialize::InputArchive nested;
      if (!archive.try_read("optimizer", nested))
        fail(path_, "holds no optimizer state (it was saved without an optimizer)");
      optimizer->load(nested);
      c10::IValue rates;
      if (archive.try_read("learning_rates", rates) && rates.isDoubleList()) {
        const auto list = rates.toDoubleList();
        auto& groups = optimizer->param_groups();
        if (list.size() == groups.size())
          for (std::size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(list[i]);
      }
    }
  } catch (const c10::Error& e) {
    fail(path_, fmt::format("its optimizer state does not fit this optimizer: {}",
                            e.what_without_backtrace()));
  }
  {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < saved.params.size(); ++i)
      model.parameters[i].tensor.copy_(saved.params[i]);
    for (std::size_t i = 0; i < saved.buffers.size(); ++i)
      model.buffers[i].tensor.copy_(saved.buffers[i]);
  }
  if (scheduler != nullptr) SchedulerSteps::of(*scheduler) = static_cast<unsigned>(scheduler_steps);
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(saved.rng);
  }
  // A resume (the optimizer too) tells the model's Aggregator where the run was;
  // loading weights alone is an initialisation, not a resume.
  if (optimizer != nullptr)
    detail::noteResumed(model, detail::Resumed{state.step, state.position, path_});
  return state;
}

TrainingState Checkpoint::load(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                               const std::map<std::string, std::string>& settings,
                               torch::optim::LRScheduler* scheduler) const {
  return load(viewOf(model), &optimizer, settings, scheduler);
}

std::string Checkpoint::identity() const {
  if (!exists()) return "";
  std::uint64_t crc = 0;
  const std::string payload = detail::readVerified(path_, &crc);
  return identityOf(crc, payload.size());
}

}  // namespace gradagg
