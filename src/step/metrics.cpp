#include "step/metrics.h"

#include <cstring>

#include <fmt/format.h>

namespace gradagg::detail {

MetricBook::MetricBook(const SegmentMap& map) : map_(map) {}

bool MetricBook::matches(const WorkerControl& c) const {
  if (c.metric_count != names_.size()) return false;
  for (std::size_t i = 0; i < names_.size(); ++i)
    if (std::strcmp(c.metrics[i].name, names_[i].c_str()) != 0) return false;
  return true;
}

namespace {
// "'a', 'b'", or "none" (error messages only).
std::string quoted(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i)
    out += fmt::format("{}'{}'", i == 0 ? "" : ", ", names[i]);
  return out.empty() ? "none" : out;
}
}  // namespace

std::string MetricBook::namesOf(const WorkerControl& c) const {
  std::vector<std::string> names;
  for (std::uint32_t i = 0; i < c.metric_count; ++i) names.emplace_back(c.metrics[i].name);
  return quoted(names);
}

MetricBook::Collected MetricBook::collect() {
  const int n = map_.workers();
  int first = -1;  // the worker whose names are the agreed ones on the first step
  if (!agreed_) {
    for (int r = 0; r < n && first < 0; ++r)
      if (map_.control(r).samples > 0) first = r;
    if (first < 0) return {};  // nobody had samples: the step is refused anyway
    const WorkerControl& c = map_.control(first);
    for (std::uint32_t i = 0; i < c.metric_count; ++i) names_.emplace_back(c.metrics[i].name);
  }
  for (int r = 0; r < n; ++r) {
    const WorkerControl& c = map_.control(r);
    if (matches(c) || (c.samples == 0 && c.metric_count == 0)) continue;
    std::string error;
    if (agreed_) {
      error = fmt::format("worker {} returned the metrics {}; the first step's were {}", r,
                          namesOf(c), quoted(names_));
    } else {
      error = fmt::format("worker {} returned the metrics {} and worker {} {}", r, namesOf(c),
                          first, namesOf(map_.control(first)));
      names_.clear();
    }
    Collected out;
    out.error = error +
                "; the shard function must return the same metric names in every worker and "
                "every step (a worker with 0 samples may return none)";
    return out;
  }
  agreed_ = true;
  Collected out;
  out.sums.count = static_cast<int>(names_.size());
  for (std::size_t i = 0; i < names_.size(); ++i) {
    double sum = 0;
    for (int r = 0; r < n; ++r) {
      const WorkerControl& c = map_.control(r);
      if (c.metric_count > 0) sum += c.metrics[i].value;
    }
    out.sums.values[i] = sum;
  }
  return out;
}

void MetricBook::report(const MetricSums& sums, StepReport& report) const {
  if (report.metrics.size() != names_.size()) {
    report.metrics.clear();
    for (const std::string& name : names_) report.metrics[name] = 0;
    for (WorkerReport& w : report.workers) w.metrics = report.metrics;
  }
  std::size_t i = 0;
  for (auto& entry : report.metrics) {
    entry.second = i < static_cast<std::size_t>(sums.count) ? sums.values[i] : 0;
    ++i;
  }
  for (int r = 0; r < map_.workers(); ++r) {
    const WorkerControl& c = map_.control(r);
    i = 0;
    for (auto& entry : report.workers[r].metrics) {
      entry.second = c.metric_count > i ? c.metrics[i].value : 0;
      ++i;
    }
  }
}

}  // namespace gradagg::detail
