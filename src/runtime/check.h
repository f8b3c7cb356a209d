// GRADAGG_ENFORCE: checks an invariant that only a bug can break; throws
// InternalError with the file, the line, the condition and a formatted message.
#pragma once

#include <fmt/format.h>

#include <gradagg/errors.h>

#define GRADAGG_ENFORCE(cond, ...)                                                           \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      throw ::gradagg::InternalError(fmt::format("gradagg internal error at {}:{}: {} ({})", \
                                                 __FILE__, __LINE__, #cond,                  \
                                                 fmt::format(__VA_ARGS__)));                 \
    }                                                                                        \
  } while (0)
