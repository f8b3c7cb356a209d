// The flag behind gradagg::interruptWaits(): set from a signal handler, read
// by every wait on other nodes (topology/).
#pragma once

namespace gradagg::detail {

bool interruptRequested() noexcept;
// A new group of nodes starts uninterrupted.
void clearInterrupt() noexcept;

}  // namespace gradagg::detail
