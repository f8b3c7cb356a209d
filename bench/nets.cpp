#include "nets.h"

#include <string>

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/pooling.h>

namespace gradagg::bench {

namespace F = torch::nn::functional;

MlpImpl::MlpImpl(const std::vector<std::int64_t>& layers) {
  for (std::size_t i = 0; i + 1 < layers.size(); ++i)
    fc.push_back(
        register_module("fc" + std::to_string(i), torch::nn::Linear(layers[i], layers[i + 1])));
}

torch::Tensor MlpImpl::forward(torch::Tensor x) {
  for (std::size_t i = 0; i < fc.size(); ++i) {
    x = fc[i]->forward(x);
    if (i + 1 < fc.size()) x = torch::relu(x);
  }
  return x;
}

CnnImpl::CnnImpl()
    : conv1(register_module("conv1",
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)))),
      conv2(register_module("conv2",
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)))),
      bn1(register_module("bn1", torch::nn::BatchNorm2d(32))),
      bn2(register_module("bn2", torch::nn::BatchNorm2d(64))),
      dropout(register_module("dropout", torch::nn::Dropout(0.25))),
      fc1(register_module("fc1", torch::nn::Linear(64 * 7 * 7, 128))),
      fc2(register_module("fc2", torch::nn::Linear(128, kClasses))) {}

torch::Tensor CnnImpl::forward(torch::Tensor x) {
  x = F::max_pool2d(torch::relu(bn1->forward(conv1->forward(x))), F::MaxPool2dFuncOptions(2));
  x = F::max_pool2d(torch::relu(bn2->forward(conv2->forward(x))), F::MaxPool2dFuncOptions(2));
  x = dropout->forward(x.flatten(1));
  return fc2->forward(torch::relu(fc1->forward(x)));
}

TransformerImpl::TransformerImpl()
    : embed(register_module("embed", torch::nn::Embedding(kVocabulary, 128))),
      encoder(register_module(
          "encoder",
          torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
              torch::nn::TransformerEncoderLayerOptions(128, 4).dim_feedforward(512).dropout(0.1),
              4)))),
      head(register_module("head", torch::nn::Linear(128, kClasses))) {}

torch::Tensor TransformerImpl::forward(torch::Tensor x) {
  // LibTorch 1.13's encoder has no batch_first: [B, T, D] -> [T, B, D] and back.
  torch::Tensor h = encoder->forward(embed->forward(x).transpose(0, 1));
  return head->forward(h.mean(0));
}

LstmImpl::LstmImpl()
    : lstm(register_module(
          "lstm",
          torch::nn::LSTM(torch::nn::LSTMOptions(kFeatures, 128).num_layers(2).batch_first(true)))),
      head(register_module("head", torch::nn::Linear(128, kClasses))) {}

torch::Tensor LstmImpl::forward(torch::Tensor x) {
  torch::Tensor out = std::get<0>(lstm->forward(x));  // [B, T, 128]
  return head->forward(out.select(1, out.size(1) - 1));
}

}  // namespace gradagg::bench
