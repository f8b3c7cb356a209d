// The workers' metrics (ShardResult::metrics) as the parent sees them: the
// names are agreed on the first step that goes through, every later step's
// workers must return the same names (or none, with 0 samples), and the
// values are summed in rank order.
#pragma once

#include <string>
#include <vector>

#include <gradagg/step_report.h>

#include "step/layout.h"
#include "step/outcome.h"
#include "step/slots.h"

namespace gradagg::detail {

class MetricBook {
 public:
  explicit MetricBook(const SegmentMap& map);

  // After the workers arrived and none failed, the collect phase's metrics
  // (step/outcome.h): this group's sums when every worker's names are the
  // agreed ones (the first call agrees on them), else `error` says what
  // differs, naming the worker.
  struct Collected {
    MetricSums sums;
    std::string error;
  };
  Collected collect();
  // The sums (after the stage: everyone's) and each worker's values into the
  // report's maps, built on the first step and updated in place after.
  void report(const MetricSums& sums, StepReport& report) const;

 private:
  bool matches(const WorkerControl& c) const;
  std::string namesOf(const WorkerControl& c) const;

  SegmentMap map_;
  bool agreed_ = false;
  std::vector<std::string> names_;  // in name order, as workers write them
};

}  // namespace gradagg::detail
