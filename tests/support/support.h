// Test models, data, shards and the independent single-process reference.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <gradagg/gradagg.h>

namespace gradagg_test {

// kSparseEmbedding: Embedding(sparse=true) -> mean -> Linear, a sparse gradient.
enum class ModelKind { kLinear, kMlp, kConvBnEval, kConvBnTrain, kSparseEmbedding };
std::string kindName(ModelKind kind);

// A model with its own loss, so a test can run it the same way in the workers
// and in the single-process reference.
struct TestModel : torch::nn::Module {
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  virtual torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) = 0;
  ModelKind kind = ModelKind::kLinear;
};

// Deterministic model (seeded) in the given dtype and train/eval mode.
std::shared_ptr<TestModel> makeModel(ModelKind kind, torch::Dtype dtype, uint64_t seed = 7);
// A fresh model of the same kind with the same parameter and buffer values.
std::shared_ptr<TestModel> copyModel(TestModel& from);

struct Data {
  torch::Tensor x, y;
};
Data makeData(ModelKind kind, int64_t batch, torch::Dtype dtype, uint64_t seed = 11);

// Rows of a tensor pair as a torch::data map-style dataset (gradagg::data's tests).
struct Rows : torch::data::datasets::Dataset<Rows> {
  Rows(torch::Tensor x_, torch::Tensor y_) : x(std::move(x_)), y(std::move(y_)) {}
  torch::data::Example<> get(std::size_t i) override {
    const auto row = static_cast<int64_t>(i);
    return {x[row], y[row]};
  }
  torch::optional<std::size_t> size() const override { return static_cast<std::size_t>(x.size(0)); }
  torch::Tensor x, y;
};

// Row boundaries of `workers` shards of `batch` rows: equal as far as possible,
// or deliberately unequal (1, 2, 3, ... parts).
std::vector<int64_t> shardBounds(int64_t batch, int workers, bool unequal);

// A shard function: worker r computes model.loss on rows [bounds[r], bounds[r+1]).
gradagg::ShardFn shardFn(TestModel& model, const Data& data, std::vector<int64_t> bounds);

// Gradients by single-process autograd (cloned; undefined where none), of
//  - the loss of the concatenated batch, or
//  - sum_i w_i * loss_i over shards with w_i = n_i / N (by samples) or 1 / workers.
std::vector<torch::Tensor> fullBatchGrads(TestModel& model, const Data& data);
std::vector<torch::Tensor> perShardGrads(TestModel& model, const Data& data,
                                         const std::vector<int64_t>& bounds, bool by_samples);
std::vector<torch::Tensor> gradsOf(torch::nn::Module& model);
// The reference step: one optimizer step of `model` on the whole batch, in this process.
void stepOneProcess(TestModel& model, torch::optim::Optimizer& opt, const Data& data);
// The parameters' values (detached clones).
std::vector<torch::Tensor> paramsOf(torch::nn::Module& model);
// Same sizes and the same bits, tensor by tensor.
bool bitIdentical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b);

// ||a - b|| / max(||b||, tiny), in double.
double relErr(const torch::Tensor& a, const torch::Tensor& b);
// Fails the test with the parameter name when a relative error exceeds tol.
void expectClose(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                 double tol, const std::string& what);

// For tests that SIGSTOP a worker or a node: moves this process into a process
// group of its own (setpgid(0, 0); a session leader stays put). POSIX has the
// kernel send SIGHUP and SIGCONT to the stopped members of a process group that
// becomes orphaned when a process exits; in a parallel test run (all tests in
// one group under a parent that went away) that continued a stopped worker.
// A group whose leader's parent (ctest) is in another group of the same session
// is never orphaned.
void ownProcessGroup();

// Child processes of this process (all threads), from /proc.
std::vector<pid_t> childPids();

// Every test derives from this: it fails a test that leaves a child process behind,
// and gives the next test this process's thread settings as they were before (a
// test that raised them, libgomp's pool then alive, would hang the next one whose
// forked child runs a parallel op: the fork trap of DESIGN.md, in the test binary).
class GradaggTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

 private:
  int intra_op_threads_ = 0;  // at::get_num_threads() before the test
  int blas_threads_ = 0;      // gradagg::blasInfo().threads before the test (0: unknown)
};

}  // namespace gradagg_test
