// What the bench measured: one Row per (model, mode), printed as a markdown
// table and written as JSON Lines. No torch here.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace gradagg::bench {

struct Machine {
  int cores = 1;         // cores this process may use
  std::string cpu;       // "model name" from /proc/cpuinfo
  std::string libtorch;  // LibTorch version the bench was built with
  // The BLAS LibTorch's gemm runs on (gradagg/blas.h): describe(), vendor, threading.
  std::string blas, blas_vendor, blas_threading;
  std::string optimizer;  // the run's --optimizer, every mode's
};
Machine probeMachine(const std::string& libtorch_version, const std::string& optimizer);

// Median and 90th percentile (nearest rank) of a non-empty sample.
double median(std::vector<double> v);
double percentile90(std::vector<double> v);
// One step's collective as the process that reached it last saw it: the least
// of the n processes' times (values[k * stride]). The others also waited there
// for the slower one's compute; the last one waited for the collective alone.
double lastArrival(const double* values, int n, int stride);

struct Row {
  std::string model;  // layer list, e.g. "784-64-64-10"
  std::string mode;   // single | shm | gloo | reduce-only | check
  int workers = 1;    // processes that compute (single: 1)
  std::int64_t params = 0;
  std::int64_t batch = 0;  // global batch
  int threads = 0;         // intra-op threads per computing process
  int steps = 0;           // measured steps (samples), warm-up excluded
  double ms_per_step = 0;  // median
  double p90_ms = 0;
  double samples_per_s = 0;
  double reduce_ms = 0;  // median; shm: slot reduction, gloo: allreduce, reduce-only: reduceSlots
  double sync_us = 0;    // median time in synchronisation with no work (see README.md)
  std::optional<double> speedup_vs_single;
  std::map<std::string, double> extra;  // mode-specific medians: compute_ms, gbps, ...
  std::optional<bool> ok;               // check rows: shm and gloo agree
};

// One JSON object (a single line) with the machine in it.
std::string toJsonLine(const Row& row, const Machine& machine);
// The row of a line toJsonLine wrote (the machine's keys are left out);
// throws std::runtime_error when it is not one.
Row rowFromJson(const std::string& line);
void printMachine(std::ostream& out, const Machine& machine, const std::string& command);
void printTable(std::ostream& out, const std::vector<Row>& rows);

}  // namespace gradagg::bench
