#include "runtime/host_hooks.h"

namespace gradagg::detail {

namespace {
HostHooks& hooks() {
  static HostHooks h;
  return h;
}
}  // namespace

void setHostHooks(HostHooks h) { hooks() = std::move(h); }
const HostHooks& hostHooks() noexcept { return hooks(); }

void checkHostInterrupt() {
  if (const auto& check = hooks().check_interrupt) check();
}

void armHostInterrupt() {
  if (const auto& arm = hooks().arm_interrupt) arm();
}

}  // namespace gradagg::detail
