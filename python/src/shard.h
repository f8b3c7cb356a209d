// A Python shard function as a ShardFn, and a step's message between Python
// and C++.
#pragma once

#include <string>

#include <pybind11/pybind11.h>

#include <gradagg/message.h>
#include <gradagg/shard.h>

namespace gradagg::python {

// The name of obj's type ("float", "Tensor").
std::string typeName(pybind11::handle obj);

// "ValueError: ...\nTraceback ..." of a Python exception, within a worker's
// message room (the exception's line, then the end of the traceback).
std::string describePythonError(pybind11::error_already_set& e);

// fn(ctx) in a worker, the GIL held; InvalidArgument unless fn is callable.
ShardFn shardOfPython(pybind11::object fn);

// Whether this thread runs a shard function of shardOfPython's now (in a
// worker; the GIL held): gradagg.data refuses a DataLoader with processes there.
bool inShardFunction();

// A step's message from {name: tensor, int or float}; InvalidArgument naming
// the entry otherwise.
Message messageOf(const pybind11::dict& d);

// ctx.message as a dict: tensors (read-only views: clone() to keep or change
// one), and numbers as Python ints and floats.
pybind11::dict messageDict(const Message& m);

}  // namespace gradagg::python
