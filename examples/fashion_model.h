// The Fashion-MNIST model and data order, for fashion_train.cpp and for tests
// that train the same model their own way.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace fashion {

constexpr std::int64_t kClasses = 10;

// Dense(hidden, relu) -> Dense(classes): logits for softmax cross-entropy.
struct NetImpl : torch::nn::Module {
  NetImpl(std::int64_t inputs, std::int64_t hidden, std::int64_t classes = kClasses);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

// The model with initial weights drawn after torch::manual_seed(seed).
Net makeNet(std::int64_t inputs, std::int64_t hidden, std::uint64_t seed);

// Epoch `epoch`'s visiting order of n samples: DistributedSampler's,
// randperm(n) from a generator seeded with seed + epoch, which
// gradagg::data::ShardedBatches follows (the tests' reference uses this one).
torch::Tensor epochOrder(std::int64_t n, std::uint64_t seed, std::int64_t epoch);

// uint8 image rows {b, rows * cols} -> float inputs in [0, 1].
torch::Tensor toInputs(const torch::Tensor& image_bytes);

}  // namespace fashion
