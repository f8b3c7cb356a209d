// A map of text as one string, "<key length>:<key><value length>:<value>..."
// (any bytes in keys and values), for what gradagg stores or exchanges as text:
// a checkpoint's metadata and settings, the nodes' start-up agreement.
#pragma once

#include <map>
#include <optional>
#include <string>

#include <fmt/format.h>

namespace gradagg::detail {

inline std::string encodeTextMap(const std::map<std::string, std::string>& m) {
  std::string out;
  for (const auto& [k, v] : m) out += fmt::format("{}:{}{}:{}", k.size(), k, v.size(), v);
  return out;
}

// std::nullopt when `s` is not such a string.
inline std::optional<std::map<std::string, std::string>> decodeTextMap(const std::string& s) {
  std::map<std::string, std::string> out;
  std::size_t pos = 0;
  auto next = [&](std::string& text) {
    const std::size_t colon = s.find(':', pos);
    if (colon == std::string::npos || colon == pos || colon - pos > 19) return false;
    std::size_t n = 0;
    for (std::size_t i = pos; i < colon; ++i) {
      if (s[i] < '0' || s[i] > '9') return false;
      n = n * 10 + static_cast<std::size_t>(s[i] - '0');
    }
    if (n > s.size() - colon - 1) return false;
    text = s.substr(colon + 1, n);
    pos = colon + 1 + n;
    return true;
  };
  while (pos < s.size()) {
    std::string key, value;
    if (!next(key) || !next(value)) return std::nullopt;
    out[key] = std::move(value);
  }
  return out;
}

}  // namespace gradagg::detail
