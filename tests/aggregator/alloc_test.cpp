// The parent's hot path does not allocate: a counting operator new around step().
// (This executable replaces the global allocator, so it has its own binary.)
#include <atomic>
#include <cstdlib>
#include <new>

#include "support/support.h"

namespace {
std::atomic<long> g_allocations{0};
}  // namespace

// GCC sees free() on what operator new returned wherever it inlines both, and
// warns; here operator new is malloc, so free is its match.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace gradagg_test {
namespace {

class Allocations : public GradaggTest, public ::testing::WithParamInterface<ModelKind> {};

long allocationsPerStep(TestModel& model, const Data& data, bool check_list) {
  gradagg::Options o;
  o.workers = 2;
  o.check_parameter_list = check_list;
  gradagg::Aggregator agg(model, shardFn(model, data, shardBounds(16, 2, false)), o);
  for (int s = 0; s < 5; ++s) agg.step();  // warm-up
  const int steps = 200;
  const long before = g_allocations.load();
  for (int s = 0; s < steps; ++s) agg.step();
  return (g_allocations.load() - before + steps - 1) / steps;
}

TEST_P(Allocations, StepAllocatesNothingOfItsOwn) {
  auto model = makeModel(GetParam(), torch::kFloat);
  const Data data = makeData(GetParam(), 16, torch::kFloat);
  EXPECT_EQ(allocationsPerStep(*model, data, /*check_list=*/false), 0);
  // With the parameter-list check, exactly what model.parameters() allocates.
  const long before = g_allocations.load();
  { auto list = model->parameters(); }
  const long list_cost = g_allocations.load() - before;
  EXPECT_EQ(allocationsPerStep(*model, data, /*check_list=*/true), list_cost);
}

INSTANTIATE_TEST_SUITE_P(Models, Allocations,
                         ::testing::Values(ModelKind::kLinear, ModelKind::kMlp,
                                           ModelKind::kConvBnTrain),
                         [](const auto& tested) { return kindName(tested.param); });

}  // namespace
}  // namespace gradagg_test
