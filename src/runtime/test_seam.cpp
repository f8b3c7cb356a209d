#include "runtime/test_seam.h"

namespace gradagg::detail {

TestHooks& testHooks() {
  static TestHooks hooks;
  return hooks;
}

}  // namespace gradagg::detail
