#include "topology/stage/placement.h"

#include <ATen/CPUGeneratorImpl.h>

namespace gradagg::detail {

std::uint64_t parentTorchSeed() { return at::detail::getDefaultCPUGenerator().current_seed(); }

}  // namespace gradagg::detail
