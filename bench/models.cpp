#include "models.h"

#include <sstream>
#include <stdexcept>

#include <torch/nn/functional/loss.h>

namespace gradagg::bench {

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const std::string& name, Net& model) {
  if (name == "sgd") return std::make_unique<torch::optim::SGD>(model->parameters(), kLearningRate);
  if (name == "adam") return std::make_unique<torch::optim::Adam>(model->parameters());
  if (name == "adamw") return std::make_unique<torch::optim::AdamW>(model->parameters());
  throw std::invalid_argument("optimizer '" + name + "': expected sgd, adam or adamw");
}

namespace {

constexpr std::uint64_t kSeed = 20240601;

std::int64_t parseWidth(const std::string& token, const std::string& width) {
  std::size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(width, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != width.size() || v <= 0)
    throw std::invalid_argument(
        "'" + token +
        "': expected all, real, 807, 55k, 670k, 5.8m, 23m, cnn, transformer, lstm or a layer "
        "list like 784-64-64-10");
  return v;
}

}  // namespace

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

ModelSpec parseModel(const std::string& token) {
  if (token == "807") return {"784-1-1-10", {784, 1, 1, 10}, 16};
  if (token == "55k") return {"784-64-64-10", {784, 64, 64, 10}, 256};
  if (token == "670k") return {"784-512-512-10", {784, 512, 512, 10}, 256};
  if (token == "5.8m") return {"784-2048-2048-10", {784, 2048, 2048, 10}, 256};
  // 23.1M: a reduction of 92 MB per slot, past any cache (reduce-only's largest row).
  if (token == "23m") return {"784-4096-4096-768-10", {784, 4096, 4096, 768, 10}, 256};
  // Batches at which one process takes 10-200 ms a step on the development machine.
  if (token == "cnn") return {"cnn", {}, 64, Kind::kCnn};
  if (token == "transformer") return {"transformer", {}, 8, Kind::kTransformer};
  if (token == "lstm") return {"lstm", {}, 16, Kind::kLstm};
  ModelSpec spec{token, {}, 256};
  for (const std::string& width : split(token, '-'))
    spec.layers.push_back(parseWidth(token, width));
  if (spec.layers.size() < 2)
    throw std::invalid_argument("'" + token + "': a layer list needs at least two widths");
  if (spec.layers.back() < 2)
    throw std::invalid_argument("'" + token + "': the last width is the class count, at least 2");
  return spec;
}

std::vector<ModelSpec> parseModels(const std::string& list) {
  std::vector<ModelSpec> specs;
  for (const std::string& token : split(list, ',')) {
    if (token == "all") {
      for (const char* name : {"807", "55k", "670k", "5.8m"}) specs.push_back(parseModel(name));
    } else if (token == "real") {
      for (const char* name : {"cnn", "transformer", "lstm"}) specs.push_back(parseModel(name));
    } else {
      specs.push_back(parseModel(token));
    }
  }
  return specs;
}

std::int64_t paramCount(const ModelSpec& spec) {
  if (spec.kind != Kind::kMlp) {
    std::int64_t n = 0;
    for (const auto& p : makeModel(spec)->parameters()) n += p.numel();
    return n;
  }
  std::int64_t n = 0;
  for (std::size_t i = 0; i + 1 < spec.layers.size(); ++i)
    n += spec.layers[i] * spec.layers[i + 1] + spec.layers[i + 1];
  return n;
}

Net makeModel(const ModelSpec& spec) {
  torch::manual_seed(kSeed);
  switch (spec.kind) {
    case Kind::kCnn:
      return std::make_shared<CnnImpl>();
    case Kind::kTransformer:
      return std::make_shared<TransformerImpl>();
    case Kind::kLstm:
      return std::make_shared<LstmImpl>();
    case Kind::kMlp:
      break;
  }
  return std::make_shared<MlpImpl>(spec.layers);
}

Data makeData(const ModelSpec& spec) {
  torch::manual_seed(kSeed + 1);
  const std::int64_t B = spec.batch;
  const std::int64_t classes = spec.kind == Kind::kMlp ? spec.layers.back() : kClasses;
  torch::Tensor x;
  switch (spec.kind) {
    case Kind::kCnn:
      x = torch::randn({B, 1, 28, 28});
      break;
    case Kind::kTransformer:
      x = torch::randint(0, kVocabulary, {B, kSequence}, torch::kLong);
      break;
    case Kind::kLstm:
      x = torch::randn({B, kSequence, kFeatures});
      break;
    case Kind::kMlp:
      x = torch::randn({B, spec.layers.front()});
      break;
  }
  return {x, torch::randint(0, classes, {B}, torch::kLong)};
}

Shard shardOf(std::int64_t batch, int rank, int n) {
  return {batch * rank / n, batch * (rank + 1) / n};
}

torch::Tensor loss(Net& model, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::cross_entropy_loss(model->forward(x), y);
}

torch::Tensor flatGrad(Net& model) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : model->parameters()) parts.push_back(p.grad().detach().flatten());
  return torch::cat(parts).clone();
}

Row makeRow(const ModelSpec& spec, const char* mode, int workers, int threads, int steps) {
  Row row;
  row.model = spec.name;
  row.mode = mode;
  row.workers = workers;
  row.params = paramCount(spec);
  row.batch = spec.batch;
  row.threads = threads;
  row.steps = steps;
  return row;
}

}  // namespace gradagg::bench
