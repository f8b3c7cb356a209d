// step(message): what the parent decides after the fork reaches the workers.
// The parent's sampler picks each step's rows; every dtype and shape arrives
// bit for bit; a redone step sees the same message; one that does not fit is
// an InvalidArgument before anything runs.
#include <sys/mman.h>

#include <atomic>
#include <csignal>
#include <string>

#include "behaviour.h"
#include "runtime/test_seam.h"
#include "support/expect_throws.h"

namespace gradagg_test {
namespace {

// The shard of worker `rank` of `workers` in the rows the parent picked.
torch::Tensor shardRows(const torch::Tensor& rows, int rank, int workers) {
  return rows.chunk(workers)[rank];
}

TEST_F(Behaviour, TheParentsSamplerPicksEachStepsRowsThroughTheMessage) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  auto reference = copyModel(*model);
  const Data data = makeData(ModelKind::kMlp, 64, torch::kFloat);
  torch::optim::SGD sgd(model->parameters(), 0.1), sgd_ref(reference->parameters(), 0.1);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        const auto rows = shardRows(c.message.at("rows"), c.rank, c.workers);
        const double scale = c.message.at("scale").item<double>();
        const auto loss =
            model->loss(model->forward(data.x.index_select(0, rows)), data.y.index_select(0, rows));
        return gradagg::ShardResult{loss * scale, rows.size(0)};
      },
      opts(3));
  torch::manual_seed(3);  // the parent's sampler: a permutation per step, decided now
  for (int s = 0; s < 4; ++s) {
    const auto rows = torch::randperm(64).slice(0, 0, 15);
    gradagg::Message m;
    m.set("rows", rows).set("scale", 1.0 + s);
    agg.step(m);
    // One process: the mean loss over the same 15 rows.
    reference->zero_grad();
    const Data batch{data.x.index_select(0, rows), data.y.index_select(0, rows)};
    (reference->loss(reference->forward(batch.x), batch.y) * (1.0 + s)).backward();
    expectClose(gradsOf(*model), gradsOf(*reference), 1e-5, "step " + std::to_string(s));
    sgd.step();
    sgd_ref.step();
  }
}

TEST_F(Behaviour, EveryDtypeAndShapeArrivesBitForBitAndANumberAsA0DimTensor) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  torch::manual_seed(9);
  gradagg::Message sent;
  sent.set("f64", torch::randn({3, 4}, torch::kDouble))
      .set("i32", torch::randint(-1000, 1000, {2, 2, 2}, torch::kInt))
      .set("u8", torch::randint(0, 255, {5}, torch::kByte))
      .set("bool", torch::rand({7}) > 0.5)
      .set("bf16", torch::randn({3}).to(torch::kBFloat16))
      .set("empty", torch::zeros({0, 3}))
      .set("view", torch::arange(12, torch::kFloat).reshape({3, 4}).t())  // not contiguous
      .set("lr", 0.25)
      .set("epoch", 7);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        gradagg::ShardResult r{model->loss(model->forward(data.x), data.y), 4, {}};
        // The same names every step (the first step's are agreed on).
        r.metrics = {{"entries", static_cast<double>(c.message.size())},
                     {"equal", 0},
                     {"epoch", 0},
                     {"dims", -1}};
        if (c.message.empty()) return r;
        double equal = c.message.size() == sent.size() ? 1 : 0;
        for (const auto& e : sent.entries()) {
          const auto& got = c.message.at(e.name);
          if (got.scalar_type() != e.tensor.scalar_type() || !torch::equal(got, e.tensor))
            equal = 0;
        }
        r.metrics["equal"] = equal;
        r.metrics["epoch"] = static_cast<double>(c.message.at("epoch").item<int64_t>());
        r.metrics["dims"] = c.message.at("lr").dim();
        return r;
      },
      opts(2));
  const auto& report = agg.step(sent);
  EXPECT_EQ(report.metrics.at("equal"), 2) << "a worker saw other values";
  EXPECT_EQ(report.metrics.at("epoch"), 14);
  EXPECT_EQ(report.metrics.at("dims"), 0);
  // step() without a message: the workers see an empty one.
  EXPECT_EQ(agg.step().metrics.at("entries"), 0);
}

TEST_F(Behaviour, AMessageThatDoesNotFitIsAnInvalidArgumentNamingItsSizeAndNothingRuns) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  auto o = opts(2);
  o.message_bytes = 4096;
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y),
                                    c.message.contains("x") ? c.message.at("x").numel() : 1};
      },
      o);
  agg.step();
  const auto params = paramsOf(*model);
  const auto grads = gradsOf(*model);
  gradagg::Message big;
  big.set("x", torch::zeros({2048}));  // 8 KiB
  if (const auto e = expectThrows<gradagg::InvalidArgument>([&] { agg.step(big); }, "4096 bytes")) {
    EXPECT_NE(std::string(e->what()).find("Options::message_bytes"), std::string::npos);
  }
  EXPECT_EQ(agg.stepsDone(), 1);
  EXPECT_TRUE(bitIdentical(paramsOf(*model), params));
  expectClose(gradsOf(*model), grads, 0, ".grad after the refused message");
  gradagg::Message bad;
  bad.set("sparse", torch::eye(3).to_sparse());
  expectThrows<gradagg::InvalidArgument>([&] { agg.step(bad); }, "'sparse': expected a dense");
  // The aggregator goes on: a message that fits.
  gradagg::Message fits;
  fits.set("x", torch::zeros({500}));
  EXPECT_EQ(agg.step(fits).workers[1].samples, 500);
  EXPECT_EQ(agg.stepsDone(), 2);
}

TEST_F(Behaviour, AMissingEntryNamesTheEntriesThereAre) {
  gradagg::Message m;
  m.set("rows", torch::zeros({2})).set("lr", 0.1);
  expectThrows<gradagg::InvalidArgument>([&] { m.at("indices"); },
                                         "no 'indices' (it has 'rows', 'lr')");
}

TEST_F(Behaviour, ARestartedStepSeesTheSameMessage) {
  auto* fired = static_cast<std::atomic<int>*>(
      mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  fired->store(0);
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  auto reference = copyModel(*model);
  const Data data = makeData(ModelKind::kMlp, 32, torch::kFloat);
  auto o = opts(2);
  o.max_restarts = 1;
  gradagg::detail::ScopedTestHooks hooks;
  hooks->on_worker_phase = [fired](int rank, gradagg::Phase phase, int64_t step) {
    if (rank == 1 && phase == gradagg::Phase::kBackward && step == 1 && fired->exchange(1) == 0)
      ::raise(SIGKILL);
  };
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        const auto rows = shardRows(c.message.at("rows"), c.rank, c.workers);
        return gradagg::ShardResult{
            model->loss(model->forward(data.x.index_select(0, rows)), data.y.index_select(0, rows)),
            rows.size(0)};
      },
      o);
  gradagg::Message m;
  m.set("rows", torch::arange(0, 8));
  agg.step(m);
  m.set("rows", torch::arange(20, 30));
  const auto& report = agg.step(m);
  m.set("rows", torch::arange(0, 2));  // changed after step(): the copy was taken
  EXPECT_EQ(report.restarts, 1);
  const auto rows = torch::arange(20, 30);
  reference->loss(reference->forward(data.x.index_select(0, rows)), data.y.index_select(0, rows))
      .backward();
  expectClose(gradsOf(*model), gradsOf(*reference), 1e-5, "the restarted step");
  munmap(fired, 4096);
}

TEST_F(Behaviour, AWorkerWritingIntoTheMessageIsKilledWithSigsegv) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        if (c.rank == 0) const_cast<at::Tensor&>(c.message.at("rows")).add_(1);
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
      },
      opts(2));
  gradagg::Message m;
  m.set("rows", torch::arange(0, 1024));
  if (const auto e = expectThrows<gradagg::WorkerDied>([&] { agg.step(m); })) {
    EXPECT_EQ(e->rank(), 0);
    EXPECT_EQ(e->signal(), SIGSEGV);
  }
}

}  // namespace
}  // namespace gradagg_test
