// What the shard function is told (rank, worker count, step), the random numbers
// it draws, and the step report built from what the workers return.
#include "behaviour.h"

namespace gradagg_test {
namespace {

TEST_F(Behaviour, ShardFunctionIsToldItsRankWorkerCountAndStep) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        auto loss = model->loss(model->forward(data.x), data.y);
        return gradagg::ShardResult{loss, 1000 * c.workers + 100 * c.rank + c.step + 1};
      },
      opts(3));
  for (int64_t s = 0; s < 3; ++s) {
    const auto& report = agg.step();
    EXPECT_EQ(report.step, s);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(report.workers[r].samples, 3000 + 100 * r + s + 1);
  }
}

// Worker r's draw from LibTorch's default generator in step s, as a sample count.
std::vector<int64_t> randomDraws(bool seed_workers, int steps, int64_t start_step = 0) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  auto o = opts(3);
  o.seed_workers = seed_workers;
  o.start_step = start_step;
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext&) {
        const int64_t draw = 1 + static_cast<int64_t>(torch::rand({1}).item<double>() * 1e9);
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), draw};
      },
      o);
  std::vector<int64_t> out;
  for (int s = 0; s < steps; ++s)
    for (const auto& w : agg.step().workers) out.push_back(w.samples);
  return out;
}

TEST_F(Behaviour, WorkersDrawDifferentRandomNumbersReproducibly) {
  const auto first = randomDraws(true, 2), second = randomDraws(true, 2);
  EXPECT_EQ(first, second) << "seeded from (seed, rank, step): the same in two runs";
  EXPECT_NE(first[0], first[1]) << "workers 0 and 1 drew the same number";
  EXPECT_NE(first[1], first[2]);
  EXPECT_NE(first[0], first[3]) << "steps 0 and 1 drew the same number";
  // Unseeded, every worker continues the stream it inherited: all draw alike.
  const auto inherited = randomDraws(false, 1);
  EXPECT_EQ(inherited[0], inherited[1]);
}

TEST_F(Behaviour, WorkersSeedFromTheGlobalStep) {
  const auto from_zero = randomDraws(true, 5), from_three = randomDraws(true, 2, 3);
  EXPECT_EQ(from_three, std::vector<int64_t>(from_zero.begin() + 9, from_zero.end()))
      << "steps 3 and 4 of a run that started at 3 drew other numbers than the whole run's";
}

TEST_F(Behaviour, ReportGivesLossSamplesAndPhaseTimes) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 10, torch::kFloat);
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(10, 2, true)), opts(2));
  const auto& r = agg.step();
  EXPECT_EQ(r.samples, 10);
  ASSERT_EQ(r.workers.size(), 2u);
  EXPECT_GT(r.workers[0].shard_ms, 0);
  EXPECT_GT(r.workers[1].backward_ms, 0);
  EXPECT_GT(r.compute_ms, 0);
  EXPECT_GE(r.total_ms, r.publish_ms + r.compute_ms + r.apply_ms - 1e-9);
  EXPECT_LE(r.reduce_ms, r.compute_ms);  // the workers reduce inside the compute phase
  for (const auto& w : r.workers) {
    EXPECT_GE(w.wake_ms, 0);
    EXPECT_GT(w.load_ms + w.write_ms + w.reduce_ms, 0);
    EXPECT_LE(w.shard_ms + w.backward_ms + w.barrier_ms, r.compute_ms + 1e-9);
  }
  const double mean =
      (r.workers[0].loss * r.workers[0].samples + r.workers[1].loss * r.workers[1].samples) / 10;
  EXPECT_NEAR(r.loss, mean, 1e-6);
}

}  // namespace
}  // namespace gradagg_test
