// gradagg: one model trained by forked worker processes on one machine, with the
// result of single-process training. Umbrella header.
#pragma once

#include <gradagg/aggregator.h>
#include <gradagg/checkpoint.h>
#include <gradagg/errors.h>
#include <gradagg/interrupt.h>
#include <gradagg/message.h>
#include <gradagg/model.h>
#include <gradagg/options.h>
#include <gradagg/population.h>
#include <gradagg/shard.h>
#include <gradagg/step_report.h>
#include <gradagg/stop_signals.h>
