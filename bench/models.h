// The bench's models and data: MLPs with ReLU and the cnn, transformer and
// lstm networks (nets.h), trained with cross-entropy on random data with a
// fixed seed, so that every mode starts from the same parameters and sees the
// same global batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "nets.h"

#include "report.h"

namespace gradagg::bench {

constexpr double kLearningRate = 0.01;  // SGD; Adam and AdamW take 1e-3 (their defaults)

// --optimizer: "sgd", "adam" or "adamw" (torch::optim with default settings),
// the same in every mode. Throws std::invalid_argument for another name.
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const std::string& name, Net& model);

enum class Kind { kMlp, kCnn, kTransformer, kLstm };

struct ModelSpec {
  std::string name;  // layer list, e.g. "784-64-64-10", or "cnn", "transformer", "lstm"
  std::vector<std::int64_t> layers;  // kMlp only
  std::int64_t batch = 256;
  Kind kind = Kind::kMlp;
};

// The non-empty items of `s` between `sep`s ("807,55k", "784-64-64-10").
std::vector<std::string> split(const std::string& s, char sep);

// "807", "55k", "670k", "5.8m", a layer list like "784-64-64-10", "cnn",
// "transformer" or "lstm". Throws std::invalid_argument with the reason (no
// option name in it).
ModelSpec parseModel(const std::string& token);
// A comma list of the above, "all" (the four named MLPs) and "real" (cnn,
// transformer, lstm), in order.
std::vector<ModelSpec> parseModels(const std::string& list);
std::int64_t paramCount(const ModelSpec& spec);

// The same initial parameters on every call for the same spec.
Net makeModel(const ModelSpec& spec);

struct Data {
  torch::Tensor x, y;
};
// The global batch: the same on every call for the same spec.
Data makeData(const ModelSpec& spec);

// Rank r of n owns rows [begin, end) of the global batch.
struct Shard {
  std::int64_t begin, end;
};
Shard shardOf(std::int64_t batch, int rank, int n);

torch::Tensor loss(Net& model, const torch::Tensor& x, const torch::Tensor& y);
// All parameters' .grad, concatenated (a copy).
torch::Tensor flatGrad(Net& model);

// A row with the model's name, size and batch filled in.
Row makeRow(const ModelSpec& spec, const char* mode, int workers, int threads, int steps);

}  // namespace gradagg::bench
