// The bench's networks: one interface (a batch in, logits over kClasses out)
// for the MLPs and the three "real" models users train (bench/README.md):
//   cnn          28x28 images: Conv2d-BatchNorm2d-ReLU-MaxPool twice, Dropout, Linear-ReLU-Linear
//   transformer  token sequences: Embedding, 4-layer TransformerEncoder (d_model 128), mean, Linear
//   lstm         float sequences: 2-layer LSTM (hidden 128), its last step, Linear
// python/bench/bench.py builds the same networks in Python.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/modules/transformercoder.h>
#include <torch/nn/modules/transformerlayer.h>

namespace gradagg::bench {

constexpr std::int64_t kClasses = 10;
// The transformer's and the LSTM's inputs: kSequence steps; the transformer's
// tokens are below kVocabulary, the LSTM's steps have kFeatures floats.
constexpr std::int64_t kSequence = 32;
constexpr std::int64_t kVocabulary = 1000;
constexpr std::int64_t kFeatures = 32;

struct NetImpl : torch::nn::Module {
  virtual torch::Tensor forward(torch::Tensor x) = 0;
};
using Net = std::shared_ptr<NetImpl>;

struct MlpImpl : NetImpl {
  explicit MlpImpl(const std::vector<std::int64_t>& layers);
  torch::Tensor forward(torch::Tensor x) override;
  std::vector<torch::nn::Linear> fc;
};

// x: [B, 1, 28, 28] floats.
struct CnnImpl : NetImpl {
  CnnImpl();
  torch::Tensor forward(torch::Tensor x) override;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Dropout dropout{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// x: [B, kSequence] int64 tokens.
struct TransformerImpl : NetImpl {
  TransformerImpl();
  torch::Tensor forward(torch::Tensor x) override;
  torch::nn::Embedding embed{nullptr};
  torch::nn::TransformerEncoder encoder{nullptr};
  torch::nn::Linear head{nullptr};
};

// x: [B, kSequence, kFeatures] floats.
struct LstmImpl : NetImpl {
  LstmImpl();
  torch::Tensor forward(torch::Tensor x) override;
  torch::nn::LSTM lstm{nullptr};
  torch::nn::Linear head{nullptr};
};

}  // namespace gradagg::bench
