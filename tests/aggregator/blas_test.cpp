// LibTorch's BLAS and the parent's share of the machine as gradagg sees them:
// the BLAS named; in every worker threaded as the placement says; the parent's
// threads and heap as Options asks while the Aggregator lives, its own after;
// and a parent whose BLAS pool ran before the fork and between steps still
// gets working workers and the exact gradient. tests/CMakeLists.txt runs
// these again under each other BLAS the machine has (GRADAGG_EXPECT_BLAS).
#include <gradagg/blas.h>

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <malloc.h>

#include <cstdlib>
#include <fstream>
#include <iterator>

#include "aggregator/behaviour.h"

namespace gradagg_test {
namespace {

using namespace std::chrono_literals;

std::string mapsText() {
  std::ifstream maps("/proc/self/maps");
  return {std::istreambuf_iterator<char>(maps), std::istreambuf_iterator<char>()};
}

// A product big enough that every BLAS here runs it on its threads.
torch::Tensor bigProduct() {
  auto a = torch::randn({384, 384});
  for (int i = 0; i < 3; ++i) a = torch::tanh(a.mm(a) / 384);
  return a;
}

TEST_F(Behaviour, BlasInfoNamesTheLibraryThisProcessMapsAndItsThreading) {
  const gradagg::BlasInfo b = gradagg::blasInfo();
  ASSERT_FALSE(b.library.empty()) << "no sgemm_ found";
  EXPECT_NE(mapsText().find(b.library), std::string::npos) << b.describe();
  EXPECT_NE(b.vendor, "unknown") << b.describe();
  EXPECT_NE(b.threading, "unknown") << b.describe();
  EXPECT_GE(b.threads, 1) << b.describe();
  if (b.vendor == "openblas") {
    EXPECT_NE(b.config.find("OpenBLAS"), std::string::npos) << b.config;
  }
  // Where the suite is run on purpose under one BLAS, it is that one.
  if (const char* want = std::getenv("GRADAGG_EXPECT_BLAS")) {
    EXPECT_EQ(b.vendor + "-" + b.threading, want) << b.describe();
  }
}

TEST_F(Behaviour, AWorkersBlasThreadsAreItsPlacedCount) {
  auto model = makeModel(ModelKind::kMlp, torch::kFloat);
  const Data data = makeData(ModelKind::kMlp, 8, torch::kFloat);
  auto inner = shardFn(*model, data, shardBounds(8, 2, false));
  for (int threads : {1, 2}) {
    auto o = opts(2);
    o.threads_per_worker = threads;
    o.step_timeout = 30s;
    gradagg::Aggregator agg(
        *model,
        [&, threads](const gradagg::ShardContext& c) {
          bigProduct();  // the pool as it is after a gemm
          const gradagg::BlasInfo b = gradagg::blasInfo();
          if (b.fast() && b.threads != threads)
            throw std::runtime_error(
                fmt::format("BLAS threads {}, placed {}: {}", b.threads, threads, b.describe()));
          if (at::get_num_threads() != threads)
            throw std::runtime_error(fmt::format("intra-op threads {}", at::get_num_threads()));
          return inner(c);
        },
        o);
    EXPECT_NO_THROW(agg.step()) << threads << " threads";
  }
}

TEST_F(Behaviour, TheParentGetsTheThreadsItAsksForAndItsOwnSettingBackAfter) {
  at::set_num_threads(1);
  gradagg::setBlasThreads(1);
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  {
    auto o = opts(2);
    o.parent_threads = gradagg::Options::kEveryCore;
    gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(4, 2, false)), o);
    agg.step();
    EXPECT_EQ(at::get_num_threads(), gradagg::availableCores());
    const gradagg::BlasInfo b = gradagg::blasInfo();
    if (b.fast()) {
      EXPECT_EQ(b.threads, gradagg::availableCores()) << b.describe();
    }
  }
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_EQ(gradagg::blasInfo().threads, 1) << gradagg::blasInfo().describe();
  {
    // The default, one thread, and back to the process's two after shutdown().
    at::set_num_threads(2);
    gradagg::setBlasThreads(2);
    gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(4, 2, false)), opts(2));
    agg.step();
    EXPECT_EQ(at::get_num_threads(), 1);
    agg.shutdown();
    EXPECT_EQ(at::get_num_threads(), 2);
    at::set_num_threads(1);
    gradagg::setBlasThreads(1);
  }
  {
    auto o = opts(2);
    o.parent_threads = 0;  // leave it alone
    gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(4, 2, false)), o);
    EXPECT_EQ(at::get_num_threads(), 1);
  }
}

// How many of four 30 MiB blocks (Adam temporaries of 7.8M floats), held at
// once, got a mapping of their own instead of heap memory: 0 with the kept
// heap; with glibc's 128 KiB threshold all but those a free chunk of the heap
// happened to serve (at most one here).
int mappedOfFour30MiB() {
  const auto before = ::mallinfo2().hblks;
  void* blocks[4];
  for (void*& b : blocks) b = std::malloc(30 << 20);
  const int mapped = static_cast<int>(::mallinfo2().hblks - before);
  for (void* b : blocks) std::free(b);
  return mapped;
}

TEST_F(Behaviour, TheParentsHeapKeepsItsMemoryWhileTheAggregatorLivesAndNotAfter) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's allocator replaces glibc's malloc and its settings";
#endif
  auto model = makeModel(ModelKind::kLinear, torch::kFloat);
  const Data data = makeData(ModelKind::kLinear, 4, torch::kFloat);
  {
    gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(4, 2, false)), opts(2));
    agg.step();
    EXPECT_EQ(mappedOfFour30MiB(), 0);
    agg.shutdown();
    EXPECT_GE(mappedOfFour30MiB(), 3);
  }
  auto o = opts(2);
  o.keep_parent_memory = false;
  gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(4, 2, false)), o);
  EXPECT_GE(mappedOfFour30MiB(), 3);
}

TEST_F(Behaviour, AParentWhoseBlasPoolRanBeforeAndBetweenStepsGetsTheExactGradient) {
  // The fork hazard of a live thread pool (libgomp's, or OpenBLAS's own with
  // pthreads): the parent runs multi-threaded gemms before the fork and
  // between steps, the workers run theirs inside the shard function.
  at::set_num_threads(2);
  gradagg::setBlasThreads(2);
  bigProduct();
  auto model = makeModel(ModelKind::kMlp, torch::kDouble);
  auto single = copyModel(*model);
  const Data data = makeData(ModelKind::kMlp, 12, torch::kDouble);
  auto inner = shardFn(*model, data, shardBounds(12, 2, false));
  auto o = opts(2);
  o.step_timeout = 30s;  // a hang becomes a StepTimeout, not a stuck test
  gradagg::Aggregator agg(
      *model,
      [&](const gradagg::ShardContext& c) {
        bigProduct();
        return inner(c);
      },
      o);
  for (int s = 0; s < 3; ++s) {
    ASSERT_NO_THROW(agg.step()) << "step " << s;
    expectClose(gradsOf(*model), fullBatchGrads(*single, data), 1e-12, "step " + std::to_string(s));
    bigProduct();  // between steps, on the parent's cores
  }
}

}  // namespace
}  // namespace gradagg_test
