// Errors that explain: every worker that failed in a step is named, and the
// common mistakes get a hint (backward() called in the shard function, a
// parameter written in a worker, a shard with a negative sample count).
#include <csignal>
#include <stdexcept>
#include <string>

#include "behaviour.h"
#include "support/expect_throws.h"

namespace gradagg_test {
namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_F(Behaviour, EveryWorkerThatFailedIsNamedTheFirstInFull) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        if (c.rank == 1) throw std::runtime_error("bad record 17\nfirst line of its detail");
        if (c.rank == 3) throw std::runtime_error("bad record 99");
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 4};
      },
      opts(4));
  if (const auto e = expectThrows<gradagg::WorkerFailed>([&] { agg.step(); })) {
    const std::string what = e->what();
    EXPECT_EQ(e->rank(), 1);
    EXPECT_EQ(e->message(), "bad record 17\nfirst line of its detail");
    EXPECT_TRUE(
        has(what, "worker 1 failed in phase 'shard function' of step 0: bad record 17\nfirst line"))
        << what;
    EXPECT_TRUE(has(what, "worker 3 failed too, in phase 'shard function': bad record 99")) << what;
    EXPECT_FALSE(has(what, "worker 0 failed")) << what;
    EXPECT_FALSE(has(what, "worker 2 failed")) << what;
  }
  EXPECT_TRUE(agg.usable());
}

TEST_F(Behaviour, ALongMessageIsCutBetweenUtf8Characters) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  std::string long_text = "x";  // then 2-byte characters: an even cut would split one
  for (int i = 0; i < 1000; ++i) long_text += "\u00e9";
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext&) -> gradagg::ShardResult {
        throw std::runtime_error(long_text);
      },
      opts(1));
  if (const auto e = expectThrows<gradagg::WorkerFailed>([&] { agg.step(); })) {
    const std::string& m = e->message();
    ASSERT_GT(m.size(), 900u);
    EXPECT_EQ(m.size() % 2, 1u) << "cut inside a character";
    EXPECT_EQ(long_text.compare(0, m.size(), m), 0);
  }
}

TEST_F(Behaviour, AShardFunctionThatRunsBackwardItselfIsToldGradaggDoes) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kFloat);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext&) {
        auto loss = model->loss(model->forward(data.x), data.y);
        loss.backward();
        return gradagg::ShardResult{loss, 8};
      },
      opts(2));
  if (const auto e =
          expectThrows<gradagg::WorkerFailed>([&] { agg.step(); }, "ran backward() itself")) {
    EXPECT_TRUE(has(e->what(), "return the loss instead")) << e->what();
  }
  EXPECT_TRUE(agg.usable());
}

TEST_F(Behaviour, AWorkerKilledForWritingAParameterIsToldWhichAndThatTheyAreReadOnly) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kFloat);
  const auto names = model->named_parameters().keys();
  const std::string target = names.back();  // not the first: the offset must be found
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        if (c.rank == 1) {
          torch::NoGradGuard no_grad;
          model->named_parameters()[target].mul_(0.5);
        }
        return gradagg::ShardResult{model->loss(model->forward(data.x), data.y), 8};
      },
      opts(2));
  if (const auto e =
          expectThrows<gradagg::WorkerDied>([&] { agg.step(); }, "parameter '" + target + "'")) {
    EXPECT_EQ(e->signal(), SIGSEGV);
    EXPECT_TRUE(has(e->what(), "read-only in workers")) << e->what();
  }
}

TEST_F(Behaviour, ASegfaultElsewhereGetsNoParameterHint) {
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext&) -> gradagg::ShardResult {
        ::raise(SIGSEGV);
        return {};
      },
      opts(1));
  if (const auto e = expectThrows<gradagg::WorkerDied>([&] { agg.step(); })) {
    EXPECT_EQ(e->signal(), SIGSEGV);
    EXPECT_FALSE(has(e->what(), "read-only")) << e->what();
  }
}

}  // namespace
}  // namespace gradagg_test
