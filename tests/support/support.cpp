#include "support.h"

#include <dirent.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include <gradagg/blas.h>

namespace gradagg_test {

std::string kindName(ModelKind kind) {
  switch (kind) {
    case ModelKind::kLinear:
      return "Linear";
    case ModelKind::kMlp:
      return "Mlp";
    case ModelKind::kConvBnEval:
      return "ConvBnEval";
    case ModelKind::kConvBnTrain:
      return "ConvBnTrain";
    case ModelKind::kSparseEmbedding:
      return "SparseEmbedding";
  }
  return "?";
}

namespace {

// y = theta * x + bias, the parity demo's model.
struct LinearModel : TestModel {
  LinearModel() {
    theta = register_parameter("theta", torch::ones({1}));
    bias = register_parameter("bias", torch::ones({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return theta * x + bias; }
  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) override {
    return torch::mse_loss(out, y);
  }
  torch::Tensor theta, bias;
};

struct MlpModel : TestModel {
  MlpModel() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return fc2(torch::tanh(fc1(x))); }
  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) override {
    return torch::nn::functional::cross_entropy(out, y);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct ConvBnModel : TestModel {
  ConvBnModel() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 3, 3)));
    bn = register_module("bn", torch::nn::BatchNorm2d(3));
    fc = register_module("fc", torch::nn::Linear(3 * 4 * 4, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return fc(torch::relu(bn(conv(x))).flatten(1));
  }
  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) override {
    return torch::nn::functional::cross_entropy(out, y);
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
};

// Rows 10 and 11 of the embedding are never looked up (makeData draws 0..9).
struct SparseEmbeddingModel : TestModel {
  SparseEmbeddingModel() {
    emb = register_module("emb",
                          torch::nn::Embedding(torch::nn::EmbeddingOptions(12, 4).sparse(true)));
    fc = register_module("fc", torch::nn::Linear(4, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return fc(torch::relu(emb(x)).mean(1)).squeeze(1);
  }
  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) override {
    return torch::mse_loss(out, y);
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc{nullptr};
};

std::shared_ptr<TestModel> construct(ModelKind kind) {
  std::shared_ptr<TestModel> m;
  switch (kind) {
    case ModelKind::kLinear:
      m = std::make_shared<LinearModel>();
      break;
    case ModelKind::kMlp:
      m = std::make_shared<MlpModel>();
      break;
    case ModelKind::kConvBnEval:
    case ModelKind::kConvBnTrain:
      m = std::make_shared<ConvBnModel>();
      break;
    case ModelKind::kSparseEmbedding:
      m = std::make_shared<SparseEmbeddingModel>();
      break;
  }
  m->kind = kind;
  return m;
}

}  // namespace

std::shared_ptr<TestModel> makeModel(ModelKind kind, torch::Dtype dtype, uint64_t seed) {
  torch::manual_seed(seed);
  auto m = construct(kind);
  m->to(dtype);
  if (kind == ModelKind::kConvBnEval || kind == ModelKind::kConvBnTrain) {
    // Give the running statistics values that are not the defaults, so a worker
    // that ignored the parent's buffers would compute a different gradient.
    torch::NoGradGuard no_grad;
    for (auto& b : m->named_buffers()) {
      if (b.key().find("running_mean") != std::string::npos) b.value().uniform_(-0.5, 0.5);
      if (b.key().find("running_var") != std::string::npos) b.value().uniform_(0.5, 2.0);
    }
  }
  m->train(kind != ModelKind::kConvBnEval);
  return m;
}

std::shared_ptr<TestModel> copyModel(TestModel& from) {
  auto to = construct(from.kind);
  torch::NoGradGuard no_grad;
  auto src_p = from.named_parameters();
  for (auto& p : to->named_parameters()) p.value().set_data(src_p[p.key()].detach().clone());
  auto src_b = from.named_buffers();
  for (auto& b : to->named_buffers()) b.value().set_data(src_b[b.key()].detach().clone());
  for (auto& p : to->named_parameters())
    p.value().set_requires_grad(src_p[p.key()].requires_grad());
  to->train(from.is_training());
  return to;
}

Data makeData(ModelKind kind, int64_t batch, torch::Dtype dtype, uint64_t seed) {
  torch::manual_seed(seed);
  const auto opts = torch::TensorOptions().dtype(dtype);
  switch (kind) {
    case ModelKind::kLinear: {
      auto x = torch::linspace(1, 10, batch, opts);
      return {x, 3 * x + 4};
    }
    case ModelKind::kMlp:
      return {torch::randn({batch, 6}, opts), torch::randint(0, 4, {batch}, torch::kLong)};
    case ModelKind::kConvBnEval:
    case ModelKind::kConvBnTrain:
      return {torch::randn({batch, 1, 6, 6}, opts), torch::randint(0, 3, {batch}, torch::kLong)};
    case ModelKind::kSparseEmbedding:
      return {torch::randint(0, 10, {batch, 3}, torch::kLong), torch::randn({batch}, opts)};
  }
  return {};
}

std::vector<int64_t> shardBounds(int64_t batch, int workers, bool unequal) {
  std::vector<int64_t> bounds{0};
  if (!unequal) {
    for (int r = 1; r <= workers; ++r) bounds.push_back(batch * r / workers);
    return bounds;
  }
  // Shares proportional to 1, 2, ..., workers; each at least 2 rows (BatchNorm needs 2).
  const int64_t parts = int64_t{workers} * (workers + 1) / 2;
  int64_t acc = 0;
  for (int r = 1; r <= workers; ++r) {
    acc += r;
    bounds.push_back(batch * acc / parts);
  }
  return bounds;
}

gradagg::ShardFn shardFn(TestModel& model, const Data& data, std::vector<int64_t> bounds) {
  return [&model, data, bounds](const gradagg::ShardContext& ctx) {
    const int64_t b = bounds[ctx.rank], e = bounds[ctx.rank + 1];
    auto loss = model.loss(model.forward(data.x.slice(0, b, e)), data.y.slice(0, b, e));
    return gradagg::ShardResult{loss, e - b};
  };
}

std::vector<torch::Tensor> gradsOf(torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  for (auto& p : model.parameters())
    out.push_back(p.grad().defined() ? p.grad().detach().clone() : torch::Tensor());
  return out;
}

std::vector<torch::Tensor> paramsOf(torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  for (auto& p : model.parameters()) out.push_back(p.detach().clone());
  return out;
}

bool bitIdentical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k)
    if (!torch::equal(a[k], b[k])) return false;
  return true;
}

std::vector<torch::Tensor> fullBatchGrads(TestModel& model, const Data& data) {
  auto ref = copyModel(model);
  ref->loss(ref->forward(data.x), data.y).backward();
  return gradsOf(*ref);
}

void stepOneProcess(TestModel& model, torch::optim::Optimizer& opt, const Data& data) {
  opt.zero_grad();
  model.loss(model.forward(data.x), data.y).backward();
  opt.step();
}

std::vector<torch::Tensor> perShardGrads(TestModel& model, const Data& data,
                                         const std::vector<int64_t>& bounds, bool by_samples) {
  // Each shard on its own copy of the model (the parent's buffers, as every
  // worker starts from them), then sum_i w_i * grad_i, accumulated in double.
  const int workers = static_cast<int>(bounds.size()) - 1;
  const double total = static_cast<double>(bounds.back());
  std::vector<torch::Tensor> sum;
  for (int r = 0; r < workers; ++r) {
    const int64_t b = bounds[r], e = bounds[r + 1];
    const double w = by_samples ? (e - b) / total : 1.0 / workers;
    auto ref = copyModel(model);
    ref->loss(ref->forward(data.x.slice(0, b, e)), data.y.slice(0, b, e)).backward();
    auto grads = gradsOf(*ref);
    if (sum.empty()) sum.resize(grads.size());
    for (size_t k = 0; k < grads.size(); ++k) {
      if (!grads[k].defined()) continue;
      auto term = grads[k].to(torch::kDouble) * w;
      sum[k] = sum[k].defined() ? sum[k] + term : term;
    }
  }
  const auto dtype = model.parameters().front().scalar_type();
  for (auto& t : sum)
    if (t.defined()) t = t.to(dtype);
  return sum;
}

double relErr(const torch::Tensor& a, const torch::Tensor& b) {
  const double diff = (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>();
  return diff / std::max(b.to(torch::kDouble).norm().item<double>(), 1e-300);
}

void expectClose(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                 double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  // A parameter whose true gradient is ~0 (a conv bias under BatchNorm) is
  // compared relative to 1/100 of the norm of the whole gradient instead of its own.
  double whole = 0;
  for (const auto& w : want)
    if (w.defined()) whole = std::hypot(whole, w.to(torch::kDouble).norm().item<double>());
  for (size_t k = 0; k < got.size(); ++k) {
    ASSERT_EQ(got[k].defined(), want[k].defined()) << what << ": tensor " << k;
    if (!got[k].defined()) continue;
    ASSERT_EQ(got[k].sizes(), want[k].sizes()) << what << ": tensor " << k;
    const double own = want[k].to(torch::kDouble).norm().item<double>();
    const double diff =
        (got[k].to(torch::kDouble) - want[k].to(torch::kDouble)).norm().item<double>();
    EXPECT_LE(diff / std::max({own, 1e-2 * whole, 1e-300}), tol) << what << ": tensor " << k;
  }
}

std::vector<pid_t> childPids() {
  std::vector<pid_t> out;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return out;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream f(std::string("/proc/self/task/") + e->d_name + "/children");
    pid_t pid;
    while (f >> pid) out.push_back(pid);
  }
  closedir(dir);
  return out;
}

void GradaggTest::SetUp() {
  intra_op_threads_ = at::get_num_threads();
  blas_threads_ = gradagg::blasInfo().threads;
}

void GradaggTest::TearDown() {
  EXPECT_TRUE(childPids().empty())
      << "a test left " << childPids().size() << " child process(es) behind";
  at::set_num_threads(intra_op_threads_);
  if (blas_threads_ > 0) gradagg::setBlasThreads(blas_threads_);
}

void ownProcessGroup() { (void)::setpgid(0, 0); }

}  // namespace gradagg_test
