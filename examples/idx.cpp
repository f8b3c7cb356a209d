// IDX reading through zlib's gz* functions: they read gzip and plain files alike
// (gzread passes a file without a gzip header through unchanged), check the
// gzip CRC and length, and report a stream that ends early as Z_BUF_ERROR.
#include "idx.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>

#include <zlib.h>

namespace idx {
namespace {

constexpr std::uint8_t kUnsignedByte = 0x08;
// Far above any MNIST-family file; a header that claims more is corrupt.
constexpr std::size_t kMaxBytes = std::size_t{1} << 36;
constexpr unsigned kChunk = 1u << 20;

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw Error(path + ": " + problem);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

// Reads up to n bytes; fewer only at the end of the data. A corrupt or
// truncated gzip stream is an error, not a short read.
std::size_t readSome(gzFile file, const std::string& path, std::uint8_t* out, std::size_t n) {
  std::size_t got = 0;
  while (got < n) {
    const unsigned want = static_cast<unsigned>(std::min<std::size_t>(n - got, kChunk));
    const int r = gzread(file, out + got, want);
    int code = Z_OK;
    const char* message = gzerror(file, &code);
    if (r < 0 || (code != Z_OK && code != Z_STREAM_END)) {
      if (code == Z_BUF_ERROR) fail(path, "truncated gzip stream (unexpected end of file)");
      if (code == Z_ERRNO) fail(path, std::string("read error: ") + std::strerror(errno));
      fail(path, std::string("corrupt gzip stream: ") + (message ? message : "unknown zlib error"));
    }
    if (r == 0) break;
    got += static_cast<std::size_t>(r);
  }
  return got;
}

std::uint32_t bigEndian(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

std::string dimsText(const std::vector<std::uint32_t>& dims) {
  std::string s;
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? " x " : "") + std::to_string(dims[i]);
  return s;
}

std::string findFile(const std::string& dir, const std::string& name) {
  const std::string gz = dir + "/" + name + ".gz";
  if (exists(gz)) return gz;
  if (exists(dir + "/" + name)) return dir + "/" + name;
  std::string message = "missing file " + gz;
  if (dir == kDebianFashionMnistDir || dir == std::string(kDebianFashionMnistDir) + "/") {
    message += std::string(" (it comes with the Debian package ") + kDebianFashionMnistPackage +
               ": apt-get install " + kDebianFashionMnistPackage + ")";
  } else {
    message +=
        " (expected train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
        "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz in " +
        dir + ")";
  }
  throw Error("idx: " + message);
}

}  // namespace

std::size_t IdxArray::itemSize() const {
  std::size_t size = 1;
  for (std::size_t i = 1; i < dims.size(); ++i) size *= dims[i];
  return size;
}

IdxArray readIdx(const std::string& path) {
  if (!exists(path)) fail(path, "no such file");
  GzFile file(gzopen(path.c_str(), "rb"));
  if (!file) fail(path, std::string("cannot open: ") + std::strerror(errno));
  gzbuffer(file.get(), 1u << 18);

  std::uint8_t magic[4];
  if (readSome(file.get(), path, magic, 4) != 4) fail(path, "too short for an IDX header");
  if (magic[0] != 0 || magic[1] != 0) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "%02x%02x%02x%02x", magic[0], magic[1], magic[2], magic[3]);
    fail(path, std::string("bad magic 0x") + hex + " (an IDX file starts with two zero bytes)");
  }
  if (magic[2] != kUnsignedByte) {
    fail(path, "unsupported IDX type code " + std::to_string(magic[2]) +
                   " (only 8, unsigned byte, is read)");
  }
  const int ndims = magic[3];
  if (ndims == 0) fail(path, "IDX header has no dimensions");

  IdxArray array;
  std::vector<std::uint8_t> raw(4 * static_cast<std::size_t>(ndims));
  if (readSome(file.get(), path, raw.data(), raw.size()) != raw.size()) {
    fail(path, "truncated IDX header (" + std::to_string(ndims) + " dimensions announced)");
  }
  std::size_t bytes = 1;
  for (int d = 0; d < ndims; ++d) {
    array.dims.push_back(bigEndian(&raw[4 * d]));
    const std::uint32_t dim = array.dims.back();
    if (dim != 0 && bytes > kMaxBytes / dim) {
      fail(path, "IDX header claims an implausible size (" + dimsText(array.dims) + " ...)");
    }
    bytes *= dim;
  }

  // Grown as data arrives, so a corrupt header cannot make us allocate its claim.
  std::size_t got = 0;
  while (got < bytes) {
    const std::size_t n = std::min<std::size_t>(bytes - got, 16 * std::size_t{kChunk});
    array.data.resize(got + n);
    const std::size_t r = readSome(file.get(), path, array.data.data() + got, n);
    got += r;
    if (r < n) {
      fail(path, "data ends after " + std::to_string(got) + " of the " + std::to_string(bytes) +
                     " bytes its header announces (" + dimsText(array.dims) + ")");
    }
  }
  std::uint8_t extra;
  if (readSome(file.get(), path, &extra, 1) != 0) {
    fail(path, "longer than its header announces (" + dimsText(array.dims) + " = " +
                   std::to_string(bytes) + " bytes of data)");
  }
  return array;
}

void writeIdx(const std::string& path, const IdxArray& array, bool gzip) {
  std::size_t bytes = 1;
  for (auto d : array.dims) bytes *= d;
  if (array.dims.empty() || array.dims.size() > 255 || bytes != array.data.size()) {
    throw Error(path + ": writeIdx: dims (" + dimsText(array.dims) + ") do not match " +
                std::to_string(array.data.size()) + " bytes of data");
  }
  std::vector<std::uint8_t> out = {0, 0, kUnsignedByte,
                                   static_cast<std::uint8_t>(array.dims.size())};
  for (auto d : array.dims) {
    for (int shift = 24; shift >= 0; shift -= 8)
      out.push_back(static_cast<std::uint8_t>(d >> shift));
  }
  out.insert(out.end(), array.data.begin(), array.data.end());

  GzFile file(gzopen(path.c_str(), gzip ? "wb6" : "wbT"));  // T: plain, no gzip wrapping
  if (!file) fail(path, std::string("cannot create: ") + std::strerror(errno));
  for (std::size_t done = 0; done < out.size();) {
    const unsigned n = static_cast<unsigned>(std::min<std::size_t>(out.size() - done, kChunk));
    if (gzwrite(file.get(), out.data() + done, n) != static_cast<int>(n)) {
      int code = Z_OK;
      fail(path, std::string("write failed: ") + gzerror(file.get(), &code));
    }
    done += n;
  }
  if (gzclose(file.release()) != Z_OK) fail(path, "write failed when closing");
}

LabelledImages readLabelledImages(const std::string& images_path, const std::string& labels_path,
                                  int classes) {
  LabelledImages set{readIdx(images_path), readIdx(labels_path)};
  if (set.images.dims.size() != 3) {
    fail(images_path,
         "expected images (3 dimensions: n x rows x cols), got " + dimsText(set.images.dims));
  }
  if (set.labels.dims.size() != 1) {
    fail(labels_path, "expected labels (1 dimension), got " + dimsText(set.labels.dims));
  }
  if (set.images.items() == 0) fail(images_path, "holds no images");
  if (set.images.items() != set.labels.items()) {
    fail(labels_path, std::to_string(set.labels.items()) + " labels for " +
                          std::to_string(set.images.items()) + " images in " + images_path);
  }
  for (std::size_t i = 0; i < set.labels.data.size(); ++i) {
    if (set.labels.data[i] >= classes) {
      fail(labels_path, "label " + std::to_string(set.labels.data[i]) + " at index " +
                            std::to_string(i) + " is not below " + std::to_string(classes));
    }
  }
  return set;
}

MnistDir readMnistDir(const std::string& dir, int classes) {
  // Look for all four first, so a missing package is reported before any parsing.
  const std::string train_images = findFile(dir, "train-images-idx3-ubyte");
  const std::string train_labels = findFile(dir, "train-labels-idx1-ubyte");
  const std::string test_images = findFile(dir, "t10k-images-idx3-ubyte");
  const std::string test_labels = findFile(dir, "t10k-labels-idx1-ubyte");
  MnistDir out{readLabelledImages(train_images, train_labels, classes),
               readLabelledImages(test_images, test_labels, classes)};
  if (out.train.images.itemSize() != out.test.images.itemSize()) {
    fail(test_images, "images are " + dimsText(out.test.images.dims) + ", training images " +
                          dimsText(out.train.images.dims));
  }
  return out;
}

}  // namespace idx
