// expectThrows<E>(fn, "substring"): the one way the tests expect an exception.
//
//   if (const auto e = expectThrows<gradagg::WorkerDied>([&] { agg.step(); }, "signal 9")) {
//     EXPECT_EQ(e->rank(), 2);
//   }
//
// Torch-free and header-only, so every test executable can use it.
#pragma once

#include <cxxabi.h>

#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>

#include <gtest/gtest.h>

namespace gradagg_test {

// "gradagg::WorkerDied" for typeid(gradagg::WorkerDied).
inline std::string typeName(const std::type_info& type) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(
      abi::__cxa_demangle(type.name(), nullptr, nullptr, &status), std::free);
  return status == 0 && name ? name.get() : type.name();
}

// Calls fn() and returns the E it threw, for the caller to check further (rank,
// phase, signal...). Adds a failure, at the caller's line, naming E when fn()
// throws nothing or something else (then returns nothing), and when E's what()
// does not contain `substring` (then still returns it).
template <typename E, typename F>
std::optional<E> expectThrows(F&& fn, std::string_view substring = {},
                              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  const std::string expected =
      typeName(typeid(E)) +
      (substring.empty() ? std::string() : " containing \"" + std::string(substring) + "\"");
  try {
    std::forward<F>(fn)();
  } catch (const E& e) {
    if (std::string_view(e.what()).find(substring) == std::string_view::npos)
      ADD_FAILURE_AT(file, line) << "expected " << expected << "; its message is: " << e.what();
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE_AT(file, line) << "expected " << expected << "; got " << typeName(typeid(e)) << ": "
                               << e.what();
    return std::nullopt;
  } catch (...) {
    ADD_FAILURE_AT(file, line) << "expected " << expected << "; got an exception that is not a "
                               << "std::exception";
    return std::nullopt;
  }
  ADD_FAILURE_AT(file, line) << "expected " << expected << "; nothing was thrown";
  return std::nullopt;
}

}  // namespace gradagg_test
