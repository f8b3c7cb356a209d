// The IDX reader of the examples (examples/idx.h): it reads what it wrote, gzipped
// or plain, and rejects every kind of damaged file with an idx::Error that names
// the file and the problem. Torch-free; synthetic files in a temporary directory.
#include <zlib.h>

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "idx.h"

#include "fashion_support.h"
#include "runtime/temp_dir.h"
#include "support/expect_throws.h"

namespace {

using fashion_test::readBytes;
using fashion_test::writeBytes;
using gradagg::detail::TempDir;
using gradagg_test::expectThrows;

idx::IdxArray counting(std::vector<std::uint32_t> dims) {
  idx::IdxArray a;
  a.dims = std::move(dims);
  std::size_t n = 1;
  for (auto d : a.dims) n *= d;
  for (std::size_t i = 0; i < n; ++i) a.data.push_back(static_cast<std::uint8_t>(i * 7 + 3));
  return a;
}

// Raw bytes, gzipped, as a file: for headers that writeIdx would not produce.
void writeGz(const std::string& path, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

std::vector<unsigned char> header(unsigned char type, std::vector<std::uint32_t> dims) {
  std::vector<unsigned char> h = {0, 0, type, static_cast<unsigned char>(dims.size())};
  for (auto d : dims) {
    for (int s = 24; s >= 0; s -= 8) h.push_back(static_cast<unsigned char>(d >> s));
  }
  return h;
}

// Expects readIdx(path) to throw an idx::Error naming the file and containing `problem`.
void expectRejected(const std::string& path, const std::string& problem) {
  SCOPED_TRACE("reading " + path);
  if (const auto e = expectThrows<idx::Error>([&] { idx::readIdx(path); }, problem)) {
    EXPECT_NE(std::string(e->what()).find(path), std::string::npos) << e->what();
  }
}

class FashionIdxRoundTrip : public ::testing::TestWithParam<bool> {};

TEST_P(FashionIdxRoundTrip, ReadsBackWhatWasWritten) {
  TempDir dir;
  for (const auto& dims :
       std::vector<std::vector<std::uint32_t>>{{5}, {3, 4, 5}, {0, 28, 28}, {2000, 28, 28}}) {
    const auto written = counting(dims);
    writeIdx(dir.file("a.idx"), written, GetParam());
    const auto read = idx::readIdx(dir.file("a.idx"));
    EXPECT_EQ(read.dims, written.dims);
    EXPECT_EQ(read.data, written.data);
    EXPECT_EQ(read.items(), dims[0]);
  }
}
INSTANTIATE_TEST_SUITE_P(GzipAndPlain, FashionIdxRoundTrip, ::testing::Bool(),
                         [](const auto& tested) { return tested.param ? "Gzipped" : "Plain"; });

TEST(FashionIdx, RejectsAMissingFile) {
  TempDir dir;
  expectRejected(dir.file("nothing.gz"), "no such file");
}

TEST(FashionIdx, RejectsABadMagic) {
  TempDir dir;
  auto bytes = header(0x08, {2, 2});
  bytes[1] = 0x01;
  bytes.insert(bytes.end(), 4, 9);
  writeGz(dir.file("m.gz"), bytes);
  expectRejected(dir.file("m.gz"), "bad magic");
  // Not gzip and not IDX: text read through zlib's plain-file path.
  writeBytes(dir.file("text"), {'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'});
  expectRejected(dir.file("text"), "bad magic");
}

TEST(FashionIdx, RejectsAnUnsupportedTypeOrNoDimensions) {
  TempDir dir;
  auto floats = header(0x0D, {2});
  floats.insert(floats.end(), 8, 0);
  writeGz(dir.file("f.gz"), floats);
  expectRejected(dir.file("f.gz"), "unsupported IDX type code 13");
  writeGz(dir.file("z.gz"), header(0x08, {}));
  expectRejected(dir.file("z.gz"), "no dimensions");
}

TEST(FashionIdx, RejectsCountsThatDisagreeWithTheData) {
  TempDir dir;
  auto shorter = header(0x08, {10, 4});
  shorter.insert(shorter.end(), 30, 1);
  writeGz(dir.file("short.gz"), shorter);
  expectRejected(dir.file("short.gz"), "data ends after 30 of the 40 bytes");

  auto longer = header(0x08, {10, 4});
  longer.insert(longer.end(), 41, 1);
  writeGz(dir.file("long.gz"), longer);
  expectRejected(dir.file("long.gz"), "longer than its header announces");

  auto huge = header(0x08, {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu});
  writeGz(dir.file("huge.gz"), huge);
  expectRejected(dir.file("huge.gz"), "implausible size");

  writeGz(dir.file("cut.gz"), {0, 0, 8, 3, 0, 0});
  expectRejected(dir.file("cut.gz"), "truncated IDX header");
}

TEST(FashionIdx, RejectsATruncatedGzipStream) {
  TempDir dir;
  idx::writeIdx(dir.file("whole.gz"), counting({300, 28, 28}), true);
  const auto whole = readBytes(dir.file("whole.gz"));
  ASSERT_GT(whole.size(), 100u);
  // Cut inside the compressed data, and inside the 8-byte CRC/length trailer
  // (all the data is there; only the check is missing).
  for (std::size_t keep : {whole.size() / 2, whole.size() - 8, whole.size() - 3}) {
    SCOPED_TRACE("kept " + std::to_string(keep) + " of " + std::to_string(whole.size()) + " bytes");
    writeBytes(dir.file("cut.gz"), {whole.begin(), whole.begin() + static_cast<long>(keep)});
    expectRejected(dir.file("cut.gz"), "truncated gzip stream");
  }
}

TEST(FashionIdx, RejectsACorruptGzipStream) {
  TempDir dir;
  idx::writeIdx(dir.file("whole.gz"), counting({300, 28, 28}), true);
  auto bytes = readBytes(dir.file("whole.gz"));
  // The CRC-32 in the trailer: the data inflates fine and fails the check.
  bytes[bytes.size() - 6] ^= 0x5A;
  writeBytes(dir.file("crc.gz"), bytes);
  expectRejected(dir.file("crc.gz"), "corrupt gzip stream");
  // A damaged deflate block: whatever zlib makes of it, it is an error, never data.
  bytes = readBytes(dir.file("whole.gz"));
  for (std::size_t i = 20; i < 60; ++i) bytes[i] ^= 0xA5;
  writeBytes(dir.file("block.gz"), bytes);
  EXPECT_THROW(idx::readIdx(dir.file("block.gz")), idx::Error);
}

TEST(FashionIdx, RejectsImagesAndLabelsThatDisagree) {
  TempDir dir;
  idx::writeIdx(dir.file("images.gz"), counting({5, 3, 3}), true);
  idx::IdxArray labels{{4}, {0, 1, 2, 3}};
  idx::writeIdx(dir.file("labels.gz"), labels, true);
  expectThrows<idx::Error>(
      [&] { idx::readLabelledImages(dir.file("images.gz"), dir.file("labels.gz")); },
      "4 labels for 5 images");
  idx::writeIdx(dir.file("labels.gz"), idx::IdxArray{{5}, {0, 1, 2, 10, 3}}, true);
  expectThrows<idx::Error>(
      [&] { idx::readLabelledImages(dir.file("images.gz"), dir.file("labels.gz")); },
      "label 10 at index 3");
  // Labels where images are expected.
  EXPECT_THROW(idx::readLabelledImages(dir.file("labels.gz"), dir.file("labels.gz")), idx::Error);
}

TEST(FashionIdx, NamesTheMissingFileOfADirectory) {
  TempDir dir;
  idx::writeIdx(dir.file("train-images-idx3-ubyte.gz"), counting({4, 2, 2}), true);
  expectThrows<idx::Error>([&] { idx::readMnistDir(dir.path()); },
                           dir.file("train-labels-idx1-ubyte.gz"));
}

TEST(FashionIdx, ReadsTheDebianFilesWhenInstalled) {
  const std::string dir = idx::kDebianFashionMnistDir;
  if (!std::filesystem::exists(dir + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << dir << " is absent (Debian package " << idx::kDebianFashionMnistPackage << ")";
  }
  const auto data = idx::readMnistDir(dir);
  EXPECT_EQ(data.train.images.dims, (std::vector<std::uint32_t>{60000, 28, 28}));
  EXPECT_EQ(data.test.images.dims, (std::vector<std::uint32_t>{10000, 28, 28}));
  std::vector<int> per_class(10);
  for (auto label : data.train.labels.data) ++per_class[label];
  for (int c = 0; c < 10; ++c) EXPECT_EQ(per_class[c], 6000) << "class " << c;
}

}  // namespace
