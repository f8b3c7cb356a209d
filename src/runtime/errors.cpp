#include <gradagg/errors.h>

namespace gradagg {

const char* phaseName(Phase phase) {
  switch (phase) {
    case Phase::kStarting:
      return "starting";
    case Phase::kWaiting:
      return "waiting for the step";
    case Phase::kLoadingSnapshot:
      return "loading the snapshot";
    case Phase::kShard:
      return "shard function";
    case Phase::kBackward:
      return "backward";
    case Phase::kWritingSlot:
      return "writing its slot";
    case Phase::kReducing:
      return "reducing";
    case Phase::kStopping:
      return "stopping";
    case Phase::kTraining:
      return "training";
    case Phase::kScoring:
      return "scoring";
    case Phase::kPublishing:
      return "publishing its snapshot";
    case Phase::kExploiting:
      return "exploiting (deciding, copying a peer)";
  }
  return "unknown phase";
}

}  // namespace gradagg
