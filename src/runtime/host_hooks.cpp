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

}  // namespace gradagg::detail
