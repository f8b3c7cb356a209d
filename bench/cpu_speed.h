// How fast each CPU this process may use computes right now.
//
// On a virtual machine the virtual CPUs need not run at one speed: the host's
// other load can slow one of them for minutes (this 2-core VM, 2026-12-06: a
// one-thread step 45% slower on cpu1 than on cpu0, docs/benchmark.md). A step
// of N workers waits for the slowest CPU, while one process's BLAS call runs
// on one CPU, so a speedup over one process moves with the spread. The bench
// measures the spread before each mode of each round and prints it with the
// round (and in each row's JSON) so that a row can be read with it.
#pragma once

#include <string>
#include <vector>

namespace gradagg::bench {

struct CpuSpeed {
  int cpu;    // the CPU's number, as in /proc/cpuinfo and taskset
  double ms;  // median ms of a fixed one-thread kernel (a 16x2048 by 2048x2048 product)
};

// Runs the kernel on every CPU of this process's affinity mask in turn, in a
// thread pinned there (~0.1 s per CPU), all in a forked child so that this
// process's heap and threads are left as they were. Empty where the mask
// cannot be read or the child fails.
std::vector<CpuSpeed> measureCpuSpeeds();

// The slowest CPU's ms over the fastest's (1 for one CPU or none).
double spread(const std::vector<CpuSpeed>& speeds);

// "cpu0 10 ms, cpu1 6.87 ms (the slowest 1.46x the fastest)".
std::string describe(const std::vector<CpuSpeed>& speeds);

}  // namespace gradagg::bench
