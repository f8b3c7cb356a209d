#include "report.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>

#include <gradagg/blas.h>
#include <gradagg/options.h>

namespace gradagg::bench {

Machine probeMachine(const std::string& libtorch_version, const std::string& optimizer) {
  Machine m;
  m.cores = gradagg::availableCores();
  m.libtorch = libtorch_version;
  m.optimizer = optimizer;
  const BlasInfo blas = blasInfo();
  m.blas = blas.describe();
  m.blas_vendor = blas.vendor;
  m.blas_threading = blas.threading;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon != std::string::npos) m.cpu = line.substr(line.find_first_not_of(" \t", colon + 1));
    break;
  }
  if (m.cpu.empty()) m.cpu = "unknown";
  return m;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double percentile90(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto rank = static_cast<std::size_t>(std::ceil(0.9 * static_cast<double>(v.size())));
  return v[std::max<std::size_t>(rank, 1) - 1];
}

double lastArrival(const double* values, int n, int stride) {
  double least = values[0];
  for (int k = 1; k < n; ++k) least = std::min(least, values[k * stride]);
  return least;
}

std::string toJsonLine(const Row& r, const Machine& m) {
  nlohmann::ordered_json j;
  j["model"] = r.model;
  j["mode"] = r.mode;
  j["workers"] = r.workers;
  j["params"] = r.params;
  j["batch"] = r.batch;
  j["threads"] = r.threads;
  if (r.mode == "check") {
    j["ok"] = r.ok.value_or(false);
  } else {
    j["steps"] = r.steps;
    j["ms_per_step"] = r.ms_per_step;
    j["p90_ms"] = r.p90_ms;
    j["samples_per_s"] = r.samples_per_s;
    j["reduce_ms"] = r.reduce_ms;
    j["sync_us"] = r.sync_us;
    j["speedup_vs_single"] = r.speedup_vs_single ? nlohmann::ordered_json(*r.speedup_vs_single)
                                                 : nlohmann::ordered_json(nullptr);
  }
  for (const auto& [key, value] : r.extra) j[key] = value;
  j["cores"] = m.cores;
  j["cpu"] = m.cpu;
  j["libtorch"] = m.libtorch;
  j["blas"] = m.blas;
  j["blas_vendor"] = m.blas_vendor;
  j["blas_threading"] = m.blas_threading;
  j["optimizer"] = m.optimizer;
  return j.dump();
}

Row rowFromJson(const std::string& line) {
  const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("mode") || !j.contains("ms_per_step"))
    throw std::runtime_error("not a row: " + line);
  Row r;
  r.model = j.at("model").get<std::string>();
  r.mode = j.at("mode").get<std::string>();
  r.workers = j.at("workers").get<int>();
  r.params = j.at("params").get<std::int64_t>();
  r.batch = j.at("batch").get<std::int64_t>();
  r.threads = j.at("threads").get<int>();
  r.steps = j.at("steps").get<int>();
  r.ms_per_step = j.at("ms_per_step").get<double>();
  r.p90_ms = j.at("p90_ms").get<double>();
  r.reduce_ms = j.at("reduce_ms").get<double>();
  r.sync_us = j.at("sync_us").get<double>();
  static const char* const kNotExtra[] = {
      "model",       "mode",   "workers",       "params",    "batch",   "threads",          "steps",
      "ms_per_step", "p90_ms", "samples_per_s", "reduce_ms", "sync_us", "speedup_vs_single"};
  for (const auto& [key, value] : j.items()) {
    if (!value.is_number() || key == "cores") continue;
    if (std::find(std::begin(kNotExtra), std::end(kNotExtra), key) != std::end(kNotExtra)) continue;
    r.extra[key] = value.get<double>();
  }
  return r;
}

void printMachine(std::ostream& out, const Machine& m, const std::string& command) {
  out << "machine: " << m.cores << " cores, " << m.cpu << ", LibTorch " << m.libtorch << "\n"
      << "blas: " << m.blas << "\n"
      << "optimizer: " << m.optimizer << "\n"
      << "command: " << command << "\n";
}

namespace {

std::string fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

// Few significant digits, whatever the magnitude.
std::string shortNumber(double v) {
  const double a = std::fabs(v);
  return fixed(v, a >= 100 ? 0 : a >= 10 ? 1 : a >= 1 ? 2 : a >= 0.1 ? 3 : 4);
}

std::string extraOr(const Row& r, const char* key, const std::string& otherwise = "") {
  const auto it = r.extra.find(key);
  return it == r.extra.end() ? otherwise : shortNumber(it->second);
}

}  // namespace

void printTable(std::ostream& out, const std::vector<Row>& rows) {
  out << "| model | params | batch | mode | procs x threads | ms/step | p90 ms | samples/s | "
         "speedup | vs kept heap | of ceiling | compute ms | reduce ms | sync us | GB/s (stream) | "
         "gloo allreduce ms |\n"
         "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const Row& r : rows) {
    if (r.mode == "check") continue;
    const bool reduce_only = r.mode.rfind("reduce-only", 0) == 0;
    std::string gbps;
    if (reduce_only) gbps = extraOr(r, "gbps") + " (" + extraOr(r, "gbps_stream") + ")";
    out << "| " << r.model << " | " << r.params << " | "
        << (reduce_only ? "" : std::to_string(r.batch)) << " | " << r.mode << " | " << r.workers
        << " x " << r.threads << " | " << shortNumber(r.ms_per_step) << " | "
        << shortNumber(r.p90_ms) << " | " << (reduce_only ? "" : fixed(r.samples_per_s, 0)) << " | "
        << (r.speedup_vs_single ? fixed(*r.speedup_vs_single, 2) + "x" : "") << " | "
        << extraOr(r, "speedup_vs_single_kept") << " | " << extraOr(r, "of_ceiling") << " | "
        << extraOr(r, "compute_ms") << " | "
        << (r.mode.rfind("single", 0) == 0 || r.mode == "ceiling" ? "" : shortNumber(r.reduce_ms))
        << " | " << (reduce_only ? "" : fixed(r.sync_us, 0)) << " | " << gbps << " | "
        << extraOr(r, "gloo_allreduce_ms") << " |\n";
  }
  bool any_check = false;
  for (const Row& r : rows) {
    if (r.mode != "check") continue;
    if (!any_check) out << "\ngradient check (one step, same parameters and data):\n";
    any_check = true;
    out << "  " << r.model << " (" << r.params << " params, " << r.workers
        << " workers): |shm - gloo| / |gloo| = " << std::scientific << std::setprecision(2)
        << r.extra.at("rel_err_shm_gloo")
        << ", |shm - single| / |single| = " << r.extra.at("rel_err_shm_single") << std::defaultfloat
        << "  " << (r.ok.value_or(false) ? "OK" : "MISMATCH") << "\n";
  }
}

}  // namespace gradagg::bench
