// Fashion-MNIST with gradagg: the parent keeps the model and one Adam (or SGD);
// every step each worker computes the loss of its part of the global batch on
// its replica (gradagg::data::ShardedBatches), gradagg averages the gradients
// into the parent's .grad, and the parent steps its optimizer. The split is
// described in fashion_train.h.
#include "fashion_train.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <gradagg/data.h>
#include <gradagg/gradagg.h>

#include "fashion_data.h"
#include "fashion_model.h"
#include "idx.h"
#include "idx_tensor.h"

namespace fashion {

// ---- model and data order -------------------------------------------------

NetImpl::NetImpl(std::int64_t inputs, std::int64_t hidden, std::int64_t classes)
    : fc1(register_module("fc1", torch::nn::Linear(inputs, hidden))),
      fc2(register_module("fc2", torch::nn::Linear(hidden, classes))) {}

torch::Tensor NetImpl::forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }

Net makeNet(std::int64_t inputs, std::int64_t hidden, std::uint64_t seed) {
  torch::manual_seed(seed);
  return Net(inputs, hidden);
}

torch::Tensor epochOrder(std::int64_t n, std::uint64_t seed, std::int64_t epoch) {
  auto generator =
      at::make_generator<at::CPUGeneratorImpl>(seed + static_cast<std::uint64_t>(epoch));
  return torch::randperm(n, generator, torch::kLong);
}

torch::Tensor toInputs(const torch::Tensor& image_bytes) {
  return image_bytes.to(torch::kFloat).div_(255.0);
}

const char* optimizerName(OptimizerKind kind) {
  return kind == OptimizerKind::kAdam ? "adam" : "sgd";
}

namespace {

using Clock = std::chrono::steady_clock;

std::string shortNumber(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", x);
  return text;
}

double secondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

torch::Tensor crossEntropy(
    const torch::Tensor& logits, const torch::Tensor& labels,
    torch::nn::functional::CrossEntropyFuncOptions::reduction_t reduction = torch::kMean) {
  namespace F = torch::nn::functional;
  return F::cross_entropy(logits, labels, F::CrossEntropyFuncOptions().reduction(reduction));
}

// Where the run is: what a checkpoint holds besides the model and optimizer.
struct Progress {
  std::int64_t step = 0;      // steps done in all
  double epoch_loss_sum = 0;  // sum of loss * samples over the current epoch's steps
  std::int64_t epoch_samples = 0;
  std::int64_t epoch_correct = 0;  // training samples classified right (StepReport::metrics)
  double epoch_train_seconds = 0;
};

// The settings a checkpoint must be resumed with, and every node must share:
// anything that changes the steps. (Every node must also run as many epochs;
// a resumed run may raise --epochs, so that is not a checkpoint setting.)
std::map<std::string, std::string> trajectorySettings(const TrainConfig& c) {
  return {{"workers", std::to_string(c.workers)},    {"nodes", std::to_string(c.nodes.nodes)},
          {"batch", std::to_string(c.batch)},        {"lr", fmt::format("{}", c.lr)},
          {"optimizer", optimizerName(c.optimizer)}, {"seed", std::to_string(c.seed)},
          {"hidden", std::to_string(c.hidden)},      {"limit", std::to_string(c.limit)},
          {"single", c.single ? "1" : "0"}};
}

// The progress's numbers as checkpoint metadata, exactly ("{}" round-trips).
std::map<std::string, std::string> metadataOf(const Progress& p) {
  return {{"epoch_loss_sum", fmt::format("{}", p.epoch_loss_sum)},
          {"epoch_samples", std::to_string(p.epoch_samples)},
          {"epoch_correct", std::to_string(p.epoch_correct)},
          {"epoch_train_seconds", fmt::format("{}", p.epoch_train_seconds)}};
}

Progress progressOf(const gradagg::TrainingState& state, const std::string& path) {
  try {
    Progress p;
    p.step = state.step;
    p.epoch_loss_sum = std::stod(state.metadata.at("epoch_loss_sum"));
    p.epoch_samples = std::stoll(state.metadata.at("epoch_samples"));
    const auto correct = state.metadata.find("epoch_correct");  // older checkpoints: none
    p.epoch_correct = correct == state.metadata.end() ? 0 : std::stoll(correct->second);
    p.epoch_train_seconds = std::stod(state.metadata.at("epoch_train_seconds"));
    return p;
  } catch (const std::exception&) {
    throw gradagg::CheckpointError(
        "--resume: " + path + " is a gradagg checkpoint, but not one of fashion_mnist", path);
  }
}

struct Evaluation {
  double loss = 0, accuracy = 0;
};

Evaluation evaluate(Net& model, const torch::Tensor& inputs, const torch::Tensor& labels) {
  torch::NoGradGuard no_grad;
  model->eval();
  double loss_sum = 0;
  std::int64_t correct = 0;
  const std::int64_t n = inputs.size(0);
  for (std::int64_t i = 0; i < n; i += 2000) {
    const auto x = inputs.slice(0, i, std::min(n, i + 2000));
    const auto y = labels.slice(0, i, std::min(n, i + 2000));
    const auto logits = model->forward(x);
    loss_sum += crossEntropy(logits, y, torch::kSum).item<double>();
    correct += logits.argmax(1).eq(y).sum().item<std::int64_t>();
  }
  model->train();
  return {loss_sum / std::max<std::int64_t>(n, 1),
          static_cast<double>(correct) / std::max<std::int64_t>(n, 1)};
}

void validate(const TrainConfig& c) {
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("bad setting: " + what);
  };
  require(c.workers >= 1 && c.workers <= gradagg::Options::kMaxWorkers,
          "--workers must be 1.." + std::to_string(gradagg::Options::kMaxWorkers));
  require(c.batch >= 1, "--batch must be at least 1");
  require(c.epochs >= 0, "--epochs must not be negative");
  require(c.hidden >= 1, "--hidden must be at least 1");
  require(c.lr > 0, "--lr must be positive");
  require(c.limit >= 0, "--limit must not be negative");
  require(c.step_timeout_s >= 1, "the step timeout must be at least 1 s");
  require(c.threads >= 0, "--threads must not be negative");
  require(c.checkpoint_every >= 0 && c.stop_after >= 0, "step counts must not be negative");
}

}  // namespace

TrainResult train(const TrainConfig& config, const TrainCallbacks& callbacks) {
  validate(config);
  // Checked now, not at the first save an epoch later: the file can be written
  // (node 0 writes; every node holds the same bits) and the resumed one read.
  std::optional<gradagg::Checkpoint> checkpoint, resume;
  if (!config.checkpoint.empty() && config.nodes.node_rank == 0)
    checkpoint.emplace(config.checkpoint);
  if (!config.resume.empty()) resume.emplace(config.resume, gradagg::Checkpoint::Access::kReadOnly);
  // `workers` counts the workers of every node: the data split is global.
  const int workers = config.single ? config.workers : config.workers * config.nodes.nodes;
  const int batch = config.batch;
  auto info = [&](const std::string& line) {
    if (callbacks.on_info) callbacks.on_info(line);
  };

  // The data, read once before the workers are forked: they share these pages.
  // Training images stay uint8 {n, rows * cols}; each batch is converted when used.
  torch::Tensor train_images, train_labels, test_inputs, test_labels;
  std::int64_t available = 0;
  {
    const idx::MnistDir data = idx::readMnistDir(config.data_dir, kClasses);
    available = static_cast<std::int64_t>(data.train.images.items());
    const std::int64_t keep = config.limit > 0 ? std::min(config.limit, available) : available;
    train_images =
        idx::toTensor(data.train.images).reshape({available, -1}).slice(0, 0, keep).clone();
    train_labels = idx::labelsAsLong(data.train.labels).slice(0, 0, keep).clone();
    test_inputs = idx::imagesAsFloatRows(data.test.images);
    test_labels = idx::labelsAsLong(data.test.labels);
  }
  const std::int64_t n = train_images.size(0);
  if (n < workers) {
    throw std::invalid_argument("bad setting: " + std::to_string(n) + " training samples for " +
                                std::to_string(workers) + " workers");
  }
  // Built once, before the fork: each worker loads its own part (in the worker).
  gradagg::data::ShardedBatchesOptions data_options;
  data_options.shuffle = true;
  data_options.seed = config.seed;
  data_options.prefetch = config.prefetch;
  gradagg::data::ShardedBatches data(FashionDataset(train_images, train_labels),
                                     static_cast<std::size_t>(workers) * batch, data_options);
  const std::int64_t steps_per_epoch = data.steps_per_epoch();
  const std::int64_t total_steps = steps_per_epoch * config.epochs;

  Net model = makeNet(train_images.size(1), config.hidden, config.seed);
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (config.optimizer == OptimizerKind::kAdam) {
    optimizer = std::make_unique<torch::optim::Adam>(model->parameters(),
                                                     torch::optim::AdamOptions(config.lr));
  } else {
    optimizer = std::make_unique<torch::optim::SGD>(model->parameters(),
                                                    torch::optim::SGDOptions(config.lr));
  }
  Progress progress;
  gradagg::NodeOptions nodes = config.nodes;
  nodes.must_match = trajectorySettings(config);
  nodes.must_match["epochs"] = std::to_string(config.epochs);
  nodes.must_match["train_samples"] = std::to_string(n);
  nodes.must_match["train_labels_checksum"] = std::to_string(
      (train_labels * torch::arange(1, n + 1, torch::kLong)).sum().item<std::int64_t>());
  if (resume) {
    const gradagg::TrainingState state =
        resume->load(*model, *optimizer, trajectorySettings(config));
    nodes.resume_identity = state.identity;
    progress = progressOf(state, config.resume);
  }
  const std::int64_t first_step = progress.step;
  const std::int64_t first_epoch = first_step / steps_per_epoch;

  info("Fashion-MNIST from " + config.data_dir + ": " + std::to_string(n) + " training images" +
       (n < available ? " (the first of " + std::to_string(available) + ")" : "") + ", " +
       std::to_string(test_inputs.size(0)) + " test images");
  info(std::string(config.single ? "one process, batch " : "gradagg, ") +
       (config.single ? std::to_string(workers * batch)
                      : std::to_string(workers) + " workers x batch " + std::to_string(batch)) +
       "; " + std::to_string(steps_per_epoch) + " steps per epoch; " +
       optimizerName(config.optimizer) + " lr " + shortNumber(config.lr));
  if (!config.resume.empty() && first_step >= total_steps) {
    info(config.resume + " has done " + std::to_string(first_step / steps_per_epoch) +
         " epochs: nothing left to do (raise --epochs to go on)");
  } else if (!config.resume.empty()) {
    info("resumed from " + config.resume + " at epoch " + std::to_string(first_epoch + 1) +
         ", step " + std::to_string(first_step - first_epoch * steps_per_epoch) + " of the epoch");
  }

  // Runs in worker ctx.rank on its replica: `model` and the data are its own copies.
  // ctx.step is the global step (Options::start_step = the resumed step).
  // The last step of an epoch may leave a worker no rows: it returns 0 samples.
  auto shard = [&](const gradagg::ShardContext& ctx) {
    const auto part = data.batch(ctx);  // this worker's rows of the global batch
    if (part.data.size(0) == 0) return gradagg::ShardResult{torch::Tensor(), 0};
    const auto x = toInputs(part.data), &y = part.target;
    const auto logits = model->forward(x);
    const double correct = logits.argmax(1).eq(y).sum().item<double>();
    return gradagg::ShardResult{crossEntropy(logits, y), x.size(0), {{"correct", correct}}};
  };

  if (config.single && config.threads > 0) torch::set_num_threads(config.threads);
  std::optional<gradagg::Aggregator> aggregator;
  if (!config.single && progress.step < total_steps) {
    gradagg::Options options;
    options.workers = config.workers;
    options.nodes = nodes;
    options.start_step = progress.step;
    options.step_timeout = std::chrono::seconds(config.step_timeout_s);
    options.threads_per_worker = config.threads;  // 0: cores / workers
    aggregator.emplace(*model, shard, options);
  }

  TrainResult result;
  result.train_samples = n;
  result.test_samples = test_inputs.size(0);
  const auto session_start = Clock::now();
  while (progress.step < total_steps) {
    const std::int64_t epoch = progress.step / steps_per_epoch;
    const auto step_start = Clock::now();
    double loss = 0;
    std::int64_t samples = 0, correct = 0;
    if (aggregator) {
      const gradagg::StepReport& report =
          aggregator->step();  // .grad = mean over all workers' samples
      optimizer->step();
      loss = report.loss;
      samples = report.samples;
      correct = static_cast<std::int64_t>(report.metrics.at("correct"));  // over all workers
    } else {
      const auto global = data.global_batch(progress.step);
      const auto x = toInputs(global.data), &y = global.target;
      optimizer->zero_grad();
      const auto logits = model->forward(x);
      auto batch_loss = crossEntropy(logits, y);
      batch_loss.backward();
      optimizer->step();
      loss = batch_loss.item<double>();
      samples = x.size(0);
      correct = logits.argmax(1).eq(y).sum().item<std::int64_t>();
    }
    progress.epoch_train_seconds += secondsSince(step_start);
    progress.epoch_loss_sum += loss * static_cast<double>(samples);
    progress.epoch_samples += samples;
    progress.epoch_correct += correct;
    ++progress.step;

    if (callbacks.on_step) {
      StepProgress p;
      p.epoch = static_cast<int>(epoch);
      p.epochs = config.epochs;
      p.step_in_epoch = progress.step - epoch * steps_per_epoch;
      p.steps_per_epoch = steps_per_epoch;
      p.step = progress.step;
      p.total_steps = total_steps;
      p.loss = loss;
      p.epoch_loss = progress.epoch_loss_sum / static_cast<double>(progress.epoch_samples);
      p.samples_per_s = static_cast<double>(progress.epoch_samples) / progress.epoch_train_seconds;
      p.eta_s = secondsSince(session_start) / static_cast<double>(progress.step - first_step) *
                static_cast<double>(total_steps - progress.step);
      callbacks.on_step(p);
    }

    const bool epoch_done = progress.step % steps_per_epoch == 0;
    if (epoch_done) {
      const auto eval_start = Clock::now();
      const Evaluation eval = evaluate(model, test_inputs, test_labels);
      EpochResult r;
      r.epoch = static_cast<int>(epoch);
      r.train_loss = progress.epoch_loss_sum / static_cast<double>(progress.epoch_samples);
      r.train_accuracy =
          static_cast<double>(progress.epoch_correct) / static_cast<double>(progress.epoch_samples);
      r.test_loss = eval.loss;
      r.test_accuracy = eval.accuracy;
      r.train_seconds = progress.epoch_train_seconds;
      r.epoch_seconds = progress.epoch_train_seconds + secondsSince(eval_start);
      r.samples = progress.epoch_samples;
      r.samples_per_s = static_cast<double>(r.samples) / r.train_seconds;
      result.epochs.push_back(r);
      if (callbacks.on_epoch) callbacks.on_epoch(r);
      progress = Progress{progress.step};
    }
    const bool stop = (config.stop_after > 0 && progress.step >= config.stop_after) ||
                      (callbacks.should_stop && callbacks.should_stop());
    const bool finished = progress.step == total_steps;
    if (checkpoint &&
        (epoch_done || stop || finished ||
         (config.checkpoint_every > 0 && progress.step % config.checkpoint_every == 0))) {
      gradagg::TrainingState state;
      state.step = progress.step;
      state.metadata = metadataOf(progress);
      state.settings = trajectorySettings(config);
      // The file is written off this thread (the step goes on); the last
      // save of the run waits until it is in place.
      auto save = [&] {
        checkpoint->save(*model, *optimizer, state);
        if (stop || finished) checkpoint->wait();
      };
      if (callbacks.around_save)
        callbacks.around_save(save);
      else
        save();
    }
    if (stop && !finished) {
      result.stopped = true;
      break;
    }
  }
  aggregator.reset();  // stops and reaps the workers; the model gets its own memory back

  result.steps = progress.step;
  for (const auto& item : model->named_parameters()) {
    const auto values = item.value().detach().to(torch::kFloat).contiguous();
    const float* first = values.data_ptr<float>();
    result.parameters.push_back(
        {item.key(), values.sizes().vec(), std::vector<float>(first, first + values.numel())});
  }
  return result;
}

}  // namespace fashion
