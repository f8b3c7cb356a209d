// One model's modes, run in rounds: single, shm, gloo, ..., then single, shm,
// ... again, each round with its own warm-up and the CPUs' speeds measured
// before each mode (cpu_speed.h). A model's row per mode is its median round.
//
// --quiet-cpus X: a round during which one CPU ran more than X times slower
// than the other (the spread before any of its modes, or right after its last)
// is run again, up to kMaxRedos times, so that a row measures the modes and not
// the host's other tenants. Which rounds were redone and why goes to stderr;
// the rows carry how many (JSON `rounds_redone`).
#pragma once

#include <string>
#include <vector>

#include "modes.h"

namespace gradagg::bench {

// The names --modes takes, in the order each round runs them.
std::vector<std::string> modeNames();

// Every chosen mode (cfg.modes) on one model in cfg.rounds rounds, cfg.steps
// split among them; one row per mode, in run order. Progress goes to stderr.
std::vector<Row> runModel(const ModelSpec& spec, const Config& cfg);

}  // namespace gradagg::bench
