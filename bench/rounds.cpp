#include "rounds.h"

#include <algorithm>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>

#include "cpu_speed.h"

namespace gradagg::bench {

namespace {

// How a mode's row relates to single's: single is the base (1.0x); the others
// marked kAgainstSingle carry single's ms_per_step / theirs, same model, same round.
enum class Speedup { kBase, kAgainstSingle, kNone };

struct Mode {
  const char* name;  // --modes
  Speedup speedup;
  ModeFn run;
};

// Every mode, in the order each round runs them.
const Mode kModes[] = {
    {"single", Speedup::kBase, runSingleAsUsersRunIt},
    {"single-kept", Speedup::kAgainstSingle, runSingleKeptHeap},
    {"ceiling", Speedup::kAgainstSingle, runCeiling},
    {"shm", Speedup::kAgainstSingle, runShm},
    {"gloo", Speedup::kAgainstSingle, runGloo},
    {"shm-1node", Speedup::kNone, runShmOneNode},
    {"shm-2nodes", Speedup::kAgainstSingle, runNodes},
    {"shm-2nodes-bf16", Speedup::kAgainstSingle, runNodesBf16},
    {"shm-2nodes-after", Speedup::kAgainstSingle, runNodesAfter},
    {"reduce-only", Speedup::kNone, runReduceOnly},
};

// A round asked for more than this many runs of itself is kept as its last run.
constexpr int kMaxRedos = 3;

// Each row that computes the model with several processes, against this
// round's references: one process with the workers' heap (speedup_vs_single_kept)
// and the ceiling (of_ceiling: ceiling ms / the row's ms, 1.0 = as fast as any split).
void relateToReferences(std::vector<Row>& rows) {
  const auto ms = [&rows](const char* mode) -> double {
    for (const Row& r : rows)
      if (r.mode == mode) return r.ms_per_step;
    return 0;
  };
  const double kept = ms("single-kept"), ceiling = ms("ceiling");
  for (Row& r : rows) {
    if (r.mode.rfind("single", 0) == 0 || r.mode == "ceiling" || r.mode == "shm-1node" ||
        r.mode.rfind("reduce-only", 0) == 0 || r.ms_per_step <= 0)
      continue;
    if (kept > 0) r.extra["speedup_vs_single_kept"] = kept / r.ms_per_step;
    if (ceiling > 0) r.extra["of_ceiling"] = ceiling / r.ms_per_step;
  }
}

// One round: every chosen mode on one model, in kModes' order; the speedups
// against this round's single; each row with the CPUs' spread just before it
// (for the first row `first_spread` when given: a probe that ran just now).
std::vector<Row> runRound(const ModelSpec& spec, const Data& data, const Config& cfg,
                          std::optional<double> first_spread) {
  std::vector<Row> rows;
  std::optional<double> single_ms;
  for (const Mode& mode : kModes) {
    if (!cfg.modes.count(mode.name)) continue;
    const double cpus = first_spread ? *first_spread : spread(measureCpuSpeeds());
    first_spread.reset();
    Row row = mode.run(spec, data, cfg);
    row.extra["cpu_spread"] = cpus;
    if (mode.speedup == Speedup::kBase) {
      single_ms = row.ms_per_step;
      row.speedup_vs_single = 1.0;
    } else if (mode.speedup == Speedup::kAgainstSingle && single_ms && row.ms_per_step > 0) {
      row.speedup_vs_single = *single_ms / row.ms_per_step;
    }
    rows.push_back(std::move(row));
  }
  relateToReferences(rows);
  return rows;
}

// The widest spread before any of the round's rows.
double widestSpread(const std::vector<Row>& rows) {
  double widest = 1.0;
  for (const Row& r : rows) widest = std::max(widest, r.extra.at("cpu_spread"));
  return widest;
}

// One mode's rows of every round as one: the round with the median ms per
// step, the steps of all rounds, the median of the rounds' speedups (each
// against the single row of its own round, so a machine that slows down
// between rounds moves both sides of a ratio alike), and the rounds' spread.
Row mergeRounds(std::vector<Row> rounds, int redone) {
  std::sort(rounds.begin(), rounds.end(),
            [](const Row& a, const Row& b) { return a.ms_per_step < b.ms_per_step; });
  Row row = rounds[rounds.size() / 2];
  if (redone > 0) row.extra["rounds_redone"] = redone;
  if (rounds.size() == 1) return row;
  std::vector<double> speedups, ms;
  row.steps = 0;
  for (const Row& r : rounds) {
    row.steps += r.steps;
    ms.push_back(r.ms_per_step);
    if (r.speedup_vs_single) speedups.push_back(*r.speedup_vs_single);
  }
  if (!speedups.empty()) row.speedup_vs_single = median(speedups);
  for (const char* key : {"speedup_vs_single_kept", "of_ceiling"}) {
    std::vector<double> values;
    for (const Row& r : rounds)
      if (r.extra.count(key)) values.push_back(r.extra.at(key));
    if (!values.empty()) row.extra[key] = median(values);
  }
  row.extra["rounds"] = static_cast<double>(rounds.size());
  row.extra["round_min_ms"] = ms.front();
  row.extra["round_max_ms"] = ms.back();
  row.extra["cpu_spread_max"] = widestSpread(rounds);
  return row;
}

// One round's ms per step, mode by mode, each with the CPUs' spread before it
// ("round 1/6: single 1702 [cpus 1.36x], shm 1261 (1.35x) [cpus 1.62x], ..."):
// how far a noisy machine moves between rounds, which the rows' median hides.
std::string describeRound(int r, int rounds, const std::vector<Row>& rows) {
  std::ostringstream line;
  line << std::setprecision(4) << "round " << r + 1 << "/" << rounds << ":";
  const char* sep = " ";
  for (const Row& row : rows) {
    line << sep << row.mode << " " << row.ms_per_step;
    line << std::setprecision(3);
    if (row.speedup_vs_single && row.mode != "single")
      line << " (" << *row.speedup_vs_single << "x)";
    line << " [cpus " << row.extra.at("cpu_spread") << "x]" << std::setprecision(4);
    sep = ", ";
  }
  return line.str() + " ms";
}

// Round `r`, run again while --quiet-cpus finds it disturbed (up to kMaxRedos
// times, counted in `redone`); prints the round, and each run thrown away with why.
// `after`: with --quiet-cpus, the spread measured right after the last round
// (its check), which is also the spread before the next round's first row; in
// and out, so the probe does not run twice between two rounds.
std::vector<Row> runQuietRound(const ModelSpec& spec, const Data& data, const Config& cfg, int r,
                               int& redone, std::optional<double>& after) {
  for (int run = 0;; ++run) {
    std::vector<Row> rows = runRound(spec, data, cfg, after);
    double widest = 1.0;  // with --quiet-cpus: the spread before any row or right after the last
    if (cfg.quiet_cpus > 0) {
      after = spread(measureCpuSpeeds());
      widest = std::max(widestSpread(rows), *after);
    }
    const bool disturbed = cfg.quiet_cpus > 0 && widest > cfg.quiet_cpus;
    const std::string line = "  " + describeRound(r, cfg.rounds, rows);
    if (!disturbed || run == kMaxRedos) {
      if (cfg.rounds > 1 || run > 0) std::cerr << line << "\n";
      if (disturbed)
        std::cerr << "  (kept: " << kMaxRedos << " runs again did not find quiet CPUs)\n";
      return rows;
    }
    ++redone;
    std::ostringstream why;  // its own stream: std::cerr keeps its format
    why << std::setprecision(3) << ": again, the CPUs' spread " << widest
        << "x is past --quiet-cpus " << cfg.quiet_cpus;
    std::cerr << line << why.str() << "\n";
  }
}

}  // namespace

std::vector<std::string> modeNames() {
  std::vector<std::string> names;
  for (const Mode& m : kModes) names.push_back(m.name);
  return names;
}

std::vector<Row> runModel(const ModelSpec& spec, const Config& cfg) {
  std::cerr << "model " << spec.name << " (" << paramCount(spec) << " params, batch " << spec.batch
            << ")\n";
  const Data data = makeData(spec);
  Config round = cfg;
  round.steps = (cfg.steps + cfg.rounds - 1) / cfg.rounds;
  std::vector<std::vector<Row>> by_mode;  // [mode][round]
  int redone = 0;
  std::optional<double> after;  // --quiet-cpus: the spread right after the last round
  for (int r = 0; r < cfg.rounds; ++r) {
    std::vector<Row> rows = runQuietRound(spec, data, round, r, redone, after);
    by_mode.resize(rows.size());
    for (std::size_t m = 0; m < rows.size(); ++m) by_mode[m].push_back(std::move(rows[m]));
  }
  std::cerr << "  cpus after: " << describe(measureCpuSpeeds()) << "\n";
  std::vector<Row> merged;
  for (std::vector<Row>& rounds : by_mode) merged.push_back(mergeRounds(std::move(rounds), redone));
  return merged;
}

}  // namespace gradagg::bench
