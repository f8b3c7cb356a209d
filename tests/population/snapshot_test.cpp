// Population snapshots (src/population/layout.h): a seqlock per member, read
// across processes. Torch-free; real processes, one writer and several readers.
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <functional>
#include <vector>

#include "population/layout.h"
#include "runtime/process.h"
#include "runtime/segment.h"
#include "support/support.h"

namespace {

namespace pop = gradagg::detail::pop;

struct OneMember {
  pop::PopLayout layout;
  gradagg::detail::Segment segment;
  pop::MemberArea area;
  std::size_t floats;
  explicit OneMember(std::size_t n) : floats(n) {
    pop::PopSizes s;
    s.workers = 1;
    s.param_bytes = gradagg::detail::alignUp(n * sizeof(float), 64);
    layout = pop::PopLayout::plan(s, gradagg::detail::pageBytes());
    segment = gradagg::detail::Segment::createAnonymous(layout.segment_bytes);
    area = pop::memberArea(segment.base(), layout, 0);
  }
  void publish(std::uint64_t version, const std::function<void()>& midway = {}) {
    pop::MetaValues m;
    m.version = version;
    m.step = static_cast<std::int64_t>(version) * 10;
    pop::publish(
        area, m,
        [&](std::byte* p) {
          auto* f = reinterpret_cast<float*>(p);
          for (std::size_t i = 0; i < floats; ++i) f[i] = static_cast<float>(version);
        },
        midway);
  }
  // 0: a consistent copy of a published version; otherwise what was wrong.
  int readAndCheck(std::vector<float>& buf, std::uint64_t* version) {
    pop::MetaValues m;
    const auto all = [&](const pop::MetaValues&) { return layout.sizes.param_bytes; };
    if (!pop::read(area, &m, reinterpret_cast<std::byte*>(buf.data()), all, 1000000)) return 2;
    if (m.step != static_cast<std::int64_t>(m.version) * 10) return 3;
    for (std::size_t i = 0; i < floats; ++i)
      if (buf[i] != static_cast<float>(m.version)) return 4;
    *version = m.version;
    return 0;
  }
};

class PopulationSnapshotTest : public gradagg_test::GradaggTest {};

TEST_F(PopulationSnapshotTest, ReadersInOtherProcessesOnlyEverSeePublishedVersions) {
  OneMember m(1 << 16);  // 256 KiB per snapshot: a copy takes long enough to overlap writes
  m.publish(1);
  // Shared: how many readers are satisfied. The writer publishes until all are.
  auto* satisfied = static_cast<std::atomic<int>*>(
      ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(satisfied, MAP_FAILED);
  satisfied->store(0);
  constexpr int kReaders = 3;
  gradagg::detail::ProcessSet procs;
  procs.spawn([&] {
    std::uint64_t v = 2;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (; satisfied->load() < kReaders; ++v) {
      m.publish(v);
      if (std::chrono::steady_clock::now() > deadline) return 1;
    }
    return 0;
  });
  for (int reader = 0; reader < kReaders; ++reader) {
    procs.spawn([&] {
      std::vector<float> buf(m.layout.sizes.param_bytes / sizeof(float));
      std::uint64_t last = 0, v = 0;
      int reads = 0, versions = 0;
      while (versions < 300) {  // distinct versions seen, each read while the writer ran
        if (int bad = m.readAndCheck(buf, &v)) return 10 + bad;
        if (v < last) return 20;  // versions never go back
        versions += v != last;
        last = v;
        ++reads;
      }
      satisfied->fetch_add(1);
      return 0;
    });
  }
  const bool ended = procs.waitAll(std::chrono::seconds(120));
  ::munmap(satisfied, 4096);
  ASSERT_TRUE(ended) << "deadline";
  for (std::size_t i = 0; i < procs.size(); ++i) {
    auto exit = procs.poll(i);
    ASSERT_TRUE(exit.has_value());
    EXPECT_EQ(exit->exit_status, 0) << "process " << i << " " << exit->describe();
  }
}

TEST_F(PopulationSnapshotTest, AWriterKilledMidPublishLeavesThePreviousVersionReadable) {
  OneMember m(1000);
  m.publish(1);
  m.publish(2);
  gradagg::detail::ProcessSet procs;
  procs.spawn([&] {
    m.publish(3, [] { ::raise(SIGKILL); });
    return 0;
  });
  ASSERT_TRUE(procs.waitAll(std::chrono::seconds(30)));
  EXPECT_EQ(procs.poll(0)->signal, SIGKILL);
  std::vector<float> buf(m.layout.sizes.param_bytes / sizeof(float));
  std::uint64_t v = 0;
  ASSERT_EQ(m.readAndCheck(buf, &v), 0);
  EXPECT_EQ(v, 2u);
  // The next writer recovers the half-written slot.
  m.publish(3);
  m.publish(4);
  m.publish(5);
  ASSERT_EQ(m.readAndCheck(buf, &v), 0);
  EXPECT_EQ(v, 5u);
}

}  // namespace
