// The Fashion-MNIST training set as a torch::data dataset, for
// gradagg::data::ShardedBatches (and torch::data's own loaders).
//
// A BatchDataset: a request of indices gets its rows in one index_select each,
// already collated, which is what torch::data's Stack would build example by
// example. A Dataset<Self> with get(i) works the same way with
// ShardedBatches, which stacks the examples itself.
#pragma once

#include <cstdint>
#include <utility>

#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

namespace fashion {

class FashionDataset
    : public torch::data::datasets::BatchDataset<FashionDataset, torch::data::Example<>> {
 public:
  // uint8 image rows {n, rows * cols} (kept as bytes: a batch is converted where
  // it is used) and int64 labels {n}.
  FashionDataset(torch::Tensor images, torch::Tensor labels)
      : images_(std::move(images)), labels_(std::move(labels)) {}

  torch::data::Example<> get_batch(c10::ArrayRef<std::size_t> indices) override {
    static_assert(sizeof(std::size_t) == sizeof(std::int64_t), "indices read as int64");
    const auto rows = torch::from_blob(const_cast<std::size_t*>(indices.data()),
                                       {static_cast<std::int64_t>(indices.size())}, torch::kLong);
    return {images_.index_select(0, rows), labels_.index_select(0, rows)};
  }
  c10::optional<std::size_t> size() const override {
    return static_cast<std::size_t>(images_.size(0));
  }

 private:
  torch::Tensor images_, labels_;
};

}  // namespace fashion
