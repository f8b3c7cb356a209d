// gradagg::Checkpoint: a resumed training is the training that was not stopped,
// bit for bit; a bad path fails at once; a full disk is a CheckpointError that
// leaves the previous checkpoint as it was; every single-bit flip and every
// truncation of a checkpoint is caught on load; mismatched settings and models
// are named.
#include <sched.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>

#include <torch/csrc/jit/serialization/import.h>

#include "checkpoint/durable_file.h"
#include "runtime/temp_dir.h"
#include "support/expect_throws.h"
#include "support/support.h"

namespace gradagg_test {
namespace {

using gradagg::Checkpoint;
using gradagg::CheckpointError;
using gradagg::TrainingState;
using gradagg::detail::TempDir;

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void writeFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Names in `dir` other than `keep` and its lock (held while a Checkpoint of it
// lives): temporary or probe files left behind.
std::vector<std::string> strayFiles(const std::string& dir, const std::string& keep) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename() != keep && e.path().filename() != keep + ".lock")
      out.push_back(e.path().filename().string());
  return out;
}

// Runs `body` in a forked child (so a resource limit or a mount namespace stays
// there); returns what it returned, or the exception it threw, or how it died.
std::string inChild(const std::function<std::string()>& body) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string out;
    try {
      out = body();
    } catch (const std::exception& e) {
      out = std::string("threw: ") + e.what();
    }
    (void)!::write(fds[1], out.data(), out.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, n);
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status)) return "the child died by signal " + std::to_string(WTERMSIG(status));
  return out;
}

// A model with buffers (BatchNorm) trained by Adam through an Aggregator.
struct Training {
  explicit Training(ModelKind kind_ = ModelKind::kConvBnTrain) : kind(kind_) {}
  ModelKind kind;
  std::shared_ptr<TestModel> model = makeModel(kind, torch::kFloat);
  std::unique_ptr<torch::optim::Adam> opt =
      std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(0.01));
  Data data = makeData(kind, 12, torch::kFloat);

  void steps(int n, int workers = 2) {
    gradagg::Options options;
    options.workers = workers;
    gradagg::Aggregator agg(*model, shardFn(*model, data, shardBounds(12, workers, false)),
                            options);
    for (int s = 0; s < n; ++s) {
      opt->zero_grad();
      agg.step();
      opt->step();
    }
  }
  std::vector<torch::Tensor> state() const {
    auto out = paramsOf(*model);
    for (const auto& b : model->buffers()) out.push_back(b.clone());
    return out;
  }
};

// Rewrites the checkpoint at `path` (a torch::serialize archive, a TorchScript
// module inside the envelope) with `change` applied to the module, in a valid
// envelope: content no save() writes, which only the load's checks can refuse.
void rewriteArchive(const std::string& path,
                    const std::function<void(torch::jit::Module&)>& change) {
  std::istringstream in(gradagg::detail::readVerified(path));
  torch::jit::Module archive = torch::jit::load(in);
  change(archive);
  std::ostringstream out;
  archive.save(out);
  gradagg::detail::writeDurably(path, out.str());
}

class CheckpointTest : public GradaggTest {
 protected:
  TempDir dir_{"ckpt"};
};

TEST_F(CheckpointTest, AResumedTrainingIsTheTrainingThatWasNotStoppedBitForBit) {
  Training whole;
  whole.steps(3);
  const Checkpoint ckpt(dir_.file("run.ckpt"));
  TrainingState saved;
  saved.step = 3;
  saved.metadata = {{"loss_sum", "0.1"}, {"note", "a:b\n7:"}};
  saved.settings = {{"seed", "7"}, {"batch", "12"}};
  ckpt.save(*whole.model, *whole.opt, saved);
  const auto draw_after_save = torch::rand({4});
  whole.steps(3);

  Training resumed;  // same initial values, but we overwrite them all
  {
    torch::NoGradGuard no_grad;
    for (auto& p : resumed.model->parameters()) p.add_(1.0);
  }
  const TrainingState state =
      ckpt.load(*resumed.model, *resumed.opt, {{"batch", "12"}, {"seed", "7"}});
  EXPECT_EQ(state.step, 3);
  EXPECT_EQ(state.metadata, saved.metadata);
  EXPECT_EQ(state.settings, saved.settings);
  EXPECT_FALSE(state.identity.empty());
  EXPECT_EQ(state.identity, ckpt.identity()) << "the file read is the file on disk";
  EXPECT_TRUE(torch::equal(torch::rand({4}), draw_after_save)) << "the generator was restored";
  resumed.steps(3);
  EXPECT_TRUE(bitIdentical(resumed.state(), whole.state()));
  EXPECT_EQ(strayFiles(dir_.path(), "run.ckpt"), std::vector<std::string>{});
}

TEST_F(CheckpointTest, ABadPathFailsWhenTheRunStartsNamingIt) {
  expectThrows<CheckpointError>([&] { Checkpoint(dir_.file("missing/run.ckpt")); },
                                "missing/run.ckpt");
  expectThrows<CheckpointError>([&] { Checkpoint(dir_.file("missing/run.ckpt")); },
                                "No such file or directory");
  expectThrows<CheckpointError>([&] { Checkpoint(dir_.path()); }, "is a directory");
  expectThrows<CheckpointError>([&] { Checkpoint(""); }, "the path is empty");
  // Unwritable even for root: /proc accepts no new files.
  expectThrows<CheckpointError>([&] { Checkpoint("/proc/gradagg.ckpt"); }, "cannot be written");
  EXPECT_EQ(strayFiles(dir_.path(), ""), std::vector<std::string>{});
}

TEST_F(CheckpointTest, LoadingAMissingFileNamesIt) {
  Training run;
  const Checkpoint ckpt(dir_.file("never.ckpt"));
  EXPECT_FALSE(ckpt.exists());
  EXPECT_EQ(ckpt.identity(), "");
  expectThrows<CheckpointError>([&] { ckpt.load(*run.model, *run.opt, {}); }, "never.ckpt");
}

// Saves a good checkpoint, takes a step, then saves again where the file may not
// grow past `limit` bytes (RLIMIT_FSIZE) or the file system is full (tmpfs).
std::string fullDiskScenario(const std::string& path, bool use_fsize_limit) {
  Training run;
  const Checkpoint ckpt(path);
  ckpt.save(*run.model, *run.opt, TrainingState{1, {}, {}, {}, {}});
  const std::string good = ckpt.identity();
  const auto good_bytes = std::filesystem::file_size(path);
  if (use_fsize_limit) {
    const rlimit limit{good_bytes / 2, good_bytes / 2};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return "setrlimit failed";
  }
  run.steps(1, 1);
  try {
    ckpt.save(*run.model, *run.opt, TrainingState{2, {}, {}, {}, {}});  // written by its thread
    ckpt.wait();  // ... whose failure arrives here
    return "the second save did not fail";
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    const std::string want = use_fsize_limit ? "File too large" : "No space left on device";
    if (what.find(want) == std::string::npos) return "unexpected message: " + what;
    if (e.path() != path) return "the error names " + e.path();
  }
  if (ckpt.identity() != good) return "the previous checkpoint changed";
  Training check;
  if (ckpt.load(*check.model, *check.opt, {}).step != 1) return "the previous step is lost";
  const auto dir = std::filesystem::path(path).parent_path().string();
  const auto stray = strayFiles(dir, std::filesystem::path(path).filename().string());
  if (!stray.empty()) return "left behind: " + stray.front();
  return "";
}

TEST_F(CheckpointTest, AFileSizeLimitIsACheckpointErrorAndKeepsThePreviousCheckpoint) {
  const std::string path = dir_.file("run.ckpt");
  EXPECT_EQ(inChild([&] { return fullDiskScenario(path, true); }), "");
}

// The file is written off the training thread: a failed write is thrown by the
// next save (which then writes nothing), once, naming the step that failed.
TEST_F(CheckpointTest, AFailedWriteIsThrownOnceByTheNextSaveNamingItsStep) {
  const std::string path = dir_.file("run.ckpt");
  EXPECT_EQ(inChild([&]() -> std::string {
              Training run;
              const Checkpoint ckpt(path);
              ckpt.save(*run.model, *run.opt, TrainingState{1, {}, {}, {}, {}});
              const std::string good = ckpt.identity();
              const auto bytes = std::filesystem::file_size(path);
              const rlimit limit{bytes / 2, bytes / 2};
              if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return "setrlimit failed";
              ckpt.save(*run.model, *run.opt, TrainingState{2, {}, {}, {}, {}});
              try {
                ckpt.save(*run.model, *run.opt, TrainingState{3, {}, {}, {}, {}});
                return "the next save did not throw the failed write";
              } catch (const CheckpointError& e) {
                if (std::string(e.what()).find("(saving step 2)") == std::string::npos)
                  return std::string("unexpected message: ") + e.what();
              }
              ckpt.wait();  // said once: nothing more to throw
              if (ckpt.identity() != good) return "the previous checkpoint changed";
              return "";
            }),
            "");
}

TEST_F(CheckpointTest, AFullFileSystemIsACheckpointErrorAndKeepsThePreviousCheckpoint) {
  // A tmpfs that holds one checkpoint and a half, in a mount namespace of the child's own.
  Training probe;
  const Checkpoint sizing(dir_.file("size.ckpt"));
  sizing.save(*probe.model, *probe.opt, TrainingState{});
  sizing.wait();
  const auto bytes = std::filesystem::file_size(dir_.file("size.ckpt"));
  std::filesystem::remove(dir_.file("size.ckpt"));
  const std::string mnt = dir_.file("tmpfs");
  std::filesystem::create_directory(mnt);
  const std::string out = inChild([&]() -> std::string {
    if (::unshare(CLONE_NEWNS) != 0) return "skip: unshare(CLONE_NEWNS) needs root";
    if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return "skip: mount";
    const std::string size = "size=" + std::to_string((bytes * 3 / 2 / 4096 + 1) * 4096);
    if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, size.c_str()) != 0) return "skip: tmpfs";
    return fullDiskScenario(mnt + "/run.ckpt", false);
  });
  if (out.rfind("skip: ", 0) == 0) GTEST_SKIP() << out;
  EXPECT_EQ(out, "");
}

// Bit flips in a (small) checkpoint: the parity demo's model, y = theta * x + bias,
// with SGD's state. Every flipped file and every truncated one is refused on load.
// Tried: every bit of the 32-byte header and 3,000 random bits of the content (a
// new seed each run, printed), or with GRADAGG_FUZZ_ALL=1 every bit of the file
// (~110,000 loads, ~30 s).
TEST_F(CheckpointTest, BitFlipsAndTruncationsAreCaughtOnLoad) {
  auto theta = torch::ones({1}, torch::requires_grad()),
       bias = torch::ones({1}, torch::requires_grad());
  torch::optim::SGD sgd({theta, bias}, torch::optim::SGDOptions(0.01).momentum(0.9));
  (theta * 2 + bias).sum().backward();
  sgd.step();  // momentum buffers: the optimizer has state
  const gradagg::ModelView model{{{"theta", theta}, {"bias", bias}}, {}, {}, {}, {}};
  const std::string path = dir_.file("good.ckpt"), bad = dir_.file("bad.ckpt");
  Checkpoint(path).save(model, &sgd, TrainingState{1, {{"k", "v"}}, {{"seed", "3"}}, {}, {}});
  const std::string bytes = readFile(path);
  const Checkpoint corrupt(bad);
  std::vector<std::size_t> bits;
  const char* all = std::getenv("GRADAGG_FUZZ_ALL");
  if (all != nullptr && std::string(all) == "1") {
    for (std::size_t bit = 0; bit < bytes.size() * 8; ++bit) bits.push_back(bit);
  } else {
    for (std::size_t bit = 0; bit < 32 * 8; ++bit) bits.push_back(bit);
    const auto seed = static_cast<std::uint64_t>(::time(nullptr)) ^ ::getpid();
    std::cout << "[ fuzzing  ] content bits drawn with seed " << seed << "\n";
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<std::size_t> content(32 * 8, bytes.size() * 8 - 1);
    for (int i = 0; i < 3000; ++i) bits.push_back(content(rng));
  }
  std::size_t caught = 0, tried = 0;
  for (const std::size_t bit : bits) {
    std::string flipped = bytes;
    flipped[bit / 8] = static_cast<char>(flipped[bit / 8] ^ (1 << (bit % 8)));
    writeFile(bad, flipped);
    ++tried;
    try {
      corrupt.load(model, &sgd, {{"seed", "3"}});
    } catch (const CheckpointError& e) {
      if (e.path() == bad) ++caught;
    }
  }
  EXPECT_EQ(caught, tried) << "single-bit flips over " << bytes.size() << " bytes";
  std::cout << "[ fuzzed   ] " << caught << " of " << tried << " single-bit flips caught\n";
  for (std::size_t n = 0; n < bytes.size(); n += n < 64 ? 1 : 61) {
    writeFile(bad, bytes.substr(0, n));
    expectThrows<CheckpointError>([&] { corrupt.load(model, &sgd, {{"seed", "3"}}); }, "bad.ckpt");
  }
  EXPECT_EQ(Checkpoint(path).load(model, &sgd, {{"seed", "3"}}).metadata.at("k"), "v");
}

TEST_F(CheckpointTest, DifferentSettingsAreNamedAndChangeNothing) {
  Training run;
  const Checkpoint ckpt(dir_.file("run.ckpt"));
  ckpt.save(*run.model, *run.opt, TrainingState{5, {}, {{"seed", "1"}, {"batch", "64"}}, {}, {}});
  Training other;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : other.model->parameters()) p.add_(1.0);
  }
  const auto before = other.state();
  expectThrows<CheckpointError>(
      [&] {
        ckpt.load(*other.model, *other.opt, {{"seed", "2"}, {"batch", "64"}});
      },
      "was written with seed = 1, this run has seed = 2");
  expectThrows<CheckpointError>(
      [&] {
        ckpt.load(*other.model, *other.opt, {{"seed", "1"}});
      },
      "batch = 64, this run does not set batch");
  expectThrows<CheckpointError>(
      [&] {
        ckpt.load(*other.model, *other.opt, {{"seed", "1"}, {"batch", "64"}, {"x", "1"}});
      },
      "x = (not set)");
  EXPECT_TRUE(bitIdentical(other.state(), before));
}

TEST_F(CheckpointTest, ADifferentModelIsNamedAndChangesNothing) {
  Training run;
  const Checkpoint ckpt(dir_.file("run.ckpt"));
  ckpt.save(*run.model, *run.opt, TrainingState{});
  auto mlp = makeModel(ModelKind::kMlp, torch::kFloat);
  torch::optim::Adam adam(mlp->parameters(), torch::optim::AdamOptions(0.01));
  const auto before = paramsOf(*mlp);
  expectThrows<CheckpointError>([&] { ckpt.load(*mlp, adam, {}); }, "holds a different model");
  EXPECT_TRUE(bitIdentical(paramsOf(*mlp), before));
  auto wide = makeModel(ModelKind::kConvBnTrain, torch::kDouble);
  torch::optim::Adam adam64(wide->parameters(), torch::optim::AdamOptions(0.01));
  expectThrows<CheckpointError>([&] { ckpt.load(*wide, adam64, {}); }, "in this model");
}

// A generator state the CPU generator refuses (zeroed: an unseeded mt19937) is
// the checkpoint's error, found before the parameters, the optimizer or the
// generator are touched, not LibTorch's "Invalid mt19937 state".
TEST_F(CheckpointTest, AnInvalidGeneratorStateIsNamedAndChangesNothing) {
  Training run;
  run.steps(1);
  const Checkpoint ckpt(dir_.file("run.ckpt"));
  ckpt.save(*run.model, *run.opt, TrainingState{1, {}, {}, {}, {}});
  ckpt.wait();
  rewriteArchive(ckpt.path(), [](torch::jit::Module& m) { m.attr("rng").toTensor().zero_(); });
  Training other;
  other.steps(2);
  const auto before = other.state();
  at::Tensor generator_before;
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator_before = generator.get_state();
  }
  std::optional<CheckpointError> e;
  try {
    ckpt.load(*other.model, *other.opt, {});
  } catch (const CheckpointError& error) {
    e = error;
  } catch (const std::exception& other_error) {
    ADD_FAILURE() << "not a CheckpointError: " << other_error.what();
  }
  EXPECT_TRUE(bitIdentical(other.state(), before)) << "the parameters or buffers changed";
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    EXPECT_TRUE(torch::equal(generator.get_state(), generator_before));
  }
  ASSERT_TRUE(e.has_value()) << "no CheckpointError";
  EXPECT_EQ(e->path(), ckpt.path());
  EXPECT_NE(std::string(e->what()).find("random generator state"), std::string::npos) << e->what();
}

}  // namespace
}  // namespace gradagg_test
