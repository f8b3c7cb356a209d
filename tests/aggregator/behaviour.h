// What the aggregator's tests share beyond tests/support: the fixture of the
// Behaviour suite, whose tests are spread over several files (GoogleTest wants one
// class per suite), and the options most of them use.
#pragma once

#include <chrono>

#include "support/support.h"

namespace gradagg_test {

class Behaviour : public GradaggTest {};

// `workers` workers and a one-minute deadline: a hang fails the step, not the suite.
inline gradagg::Options opts(int workers) {
  gradagg::Options o;
  o.workers = workers;
  o.step_timeout = std::chrono::seconds(60);
  return o;
}

}  // namespace gradagg_test
