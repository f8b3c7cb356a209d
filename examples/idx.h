// IDX files (the MNIST / Fashion-MNIST format), gzipped or not, read straight
// through zlib. Torch-free: an IdxArray is plain bytes and dimensions;
// idx_tensor.h turns one into a tensor.
//
// The format: a 4-byte magic (0, 0, type code, number of dimensions), one
// big-endian uint32 per dimension, then the values in row-major order. Only
// unsigned bytes (type 0x08) are read, which is what the MNIST family uses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace idx {

// A file that cannot be read as IDX: missing, truncated, corrupt, or not what
// the caller expected. what() names the file and the problem.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct IdxArray {
  std::vector<std::uint32_t> dims;  // e.g. {60000, 28, 28} for images, {60000} for labels
  std::vector<std::uint8_t> data;   // row-major, product(dims) bytes
  // dims[0], the number of items (images, labels); 0 for a scalar.
  std::size_t items() const { return dims.empty() ? 0 : dims[0]; }
  // Bytes per item: product of dims[1..].
  std::size_t itemSize() const;
};

// Reads an IDX file, gzipped (detected by its header) or plain. Throws idx::Error
// for a missing file, a bad magic, an unsupported type, a gzip stream that is
// corrupt or ends early, or data shorter or longer than the header says.
IdxArray readIdx(const std::string& path);

// Writes `array` as IDX, gzipped when `gzip` (what the tests use to make files).
void writeIdx(const std::string& path, const IdxArray& array, bool gzip = true);

// Images and their labels, checked to agree: as many labels as images, labels
// below `classes`.
struct LabelledImages {
  IdxArray images;  // {n, rows, cols}
  IdxArray labels;  // {n}
};
LabelledImages readLabelledImages(const std::string& images_path, const std::string& labels_path,
                                  int classes = 10);

// An MNIST-layout directory: train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,
// t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz (also accepted without .gz).
struct MnistDir {
  LabelledImages train;
  LabelledImages test;
};
// Reads all four files of `dir`. A missing file is an idx::Error that names it
// and, when dir is the Debian location, the package that provides it.
MnistDir readMnistDir(const std::string& dir, int classes = 10);

// Where Debian's dataset-fashion-mnist package puts the files.
inline constexpr const char* kDebianFashionMnistDir = "/usr/share/datasets/fashion-mnist";
inline constexpr const char* kDebianFashionMnistPackage = "dataset-fashion-mnist";

}  // namespace idx
