// Cutting text to a size without splitting a UTF-8 character (Python decodes
// what a worker writes; half a character would be a UnicodeDecodeError).
#pragma once

#include <cstddef>
#include <string_view>

namespace gradagg::detail {

inline bool utf8Continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

// The largest n <= max such that text[0, n) ends between characters.
inline std::size_t utf8PrefixBytes(std::string_view text, std::size_t max) {
  if (max >= text.size()) return text.size();
  std::size_t n = max;
  while (n > 0 && utf8Continuation(text[n])) --n;
  return n;
}

// The smallest i >= from such that text[i, end) starts at a character.
inline std::size_t utf8SuffixStart(std::string_view text, std::size_t from) {
  while (from < text.size() && utf8Continuation(text[from])) ++from;
  return from;
}

}  // namespace gradagg::detail
