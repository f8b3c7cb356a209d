// The store's wire: gradagg's own, spoken between node 0's StoreServer
// (store_server.h) and every node's StoreClient (store_client.h). Every message,
// either way, is a frame: a 4-byte little-endian length (1 to kMaxFrame), then
// that many bytes. A request is an Op byte and its fields; a reply is a status
// byte (kOk, or kRefused and a field saying why) and its fields. A field is a
// 4-byte length and its bytes; a number is 8 bytes, little-endian. A client's
// first request is kHello with kMagic; anything else closes its connection.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gradagg::detail::wire {

enum Op : std::uint8_t {
  kHello = 1,   // magic                          -> (nothing)
  kSet,         // key, value                     -> (nothing)
  kCompareSet,  // key, expected, desired         -> the value now (c10d's rule)
  kGet,         // key                            -> value (refused: no such key)
  kAdd,         // key, number                    -> the sum, kept as decimal text
  kDelete,      // key                            -> 1 byte: it was there
  kCheck,       // number of keys, each key       -> 1 byte: all are there
  kNumKeys,     //                                -> number
};
enum Status : std::uint8_t { kOk = 0, kRefused = 1 };

inline constexpr char kMagic[] = "gradagg-store/1";
// The longest frame either side accepts: the start-up's largest value (the
// model's layout as text) is far below it; a longer length closes the connection.
inline constexpr std::size_t kMaxFrame = std::size_t{64} << 20;

// Builds one frame.
class Writer {
 public:
  Writer() : out_(4, '\0') {}
  Writer& byte(std::uint8_t b) {
    out_.push_back(static_cast<char>(b));
    return *this;
  }
  Writer& number(std::int64_t n) {
    putLE(static_cast<std::uint64_t>(n), 8);
    return *this;
  }
  Writer& field(const std::string& bytes) {
    putLE(bytes.size(), 4);
    out_ += bytes;
    return *this;
  }
  // The frame, its length filled in.
  std::string frame() {
    const std::uint64_t n = out_.size() - 4;
    for (int i = 0; i < 4; ++i) out_[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return std::move(out_);
  }

 private:
  void putLE(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

inline std::uint64_t readLE(const char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

// Reads one frame's body; a read past its end leaves ok() false.
class Reader {
 public:
  explicit Reader(const std::string& body) : p_(body.data()), left_(body.size()) {}
  std::uint8_t byte() { return take(1) ? static_cast<std::uint8_t>(p_[-1]) : 0; }
  std::int64_t number() { return take(8) ? static_cast<std::int64_t>(readLE(p_ - 8, 8)) : 0; }
  std::string field() {
    if (!take(4)) return {};
    const auto n = static_cast<std::size_t>(readLE(p_ - 4, 4));
    return take(n) ? std::string(p_ - n, n) : std::string();
  }
  bool ok() const { return ok_; }
  // Read to its end, and no further.
  bool done() const { return ok_ && left_ == 0; }

 private:
  bool take(std::size_t n) {
    if (!ok_ || n > left_) return ok_ = false;
    p_ += n;
    left_ -= n;
    return true;
  }
  const char* p_;
  std::size_t left_;
  bool ok_ = true;
};

}  // namespace gradagg::detail::wire
