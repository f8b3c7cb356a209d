// gradagg.Checkpoint's file handling is the C++ Checkpoint's, not a copy of it:
// the temporary file, fsync, rename, directory fsync and the CRC-64 checked
// before anything is parsed (checkpoint/durable_file.cpp), the writer thread
// that does it while training goes on (checkpoint/checkpoint_writer.h), and the
// note a load leaves for the model's Aggregator (model/resumed.h). Python only
// makes the payload (torch.save) and reads it back (torch.load).
#include "durable.h"

#include <cstdint>
#include <string>
#include <utility>

#include <gradagg/checkpoint.h>

#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/durable_file.h"
#include "model/resumed.h"
#include "model_view.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace gradagg::python {

void bindDurable(py::module_& m) {
  m.def(
      "_check_writable",
      [](const std::string& path) {
        py::gil_scoped_release nogil;
        detail::checkWritable(path);
      },
      "path"_a,
      "Raises CheckpointError unless a new file can be written at path (a probe file is "
      "created and removed).");
  m.def(
      "_write_durably",
      [](const std::string& path, const py::bytes& payload) {
        std::string bytes = payload;  // copied while the GIL is held
        py::gil_scoped_release nogil;
        detail::writeDurably(path, bytes);
      },
      "path"_a, "payload"_a,
      "Writes header + payload to <path>.tmp-<pid>, fsyncs it, renames it over path and fsyncs "
      "the directory; on failure path keeps what it had and CheckpointError is raised.");
  m.def(
      "_read_verified",
      [](const std::string& path) {
        std::uint64_t crc = 0;
        std::string payload;
        {
          py::gil_scoped_release nogil;
          payload = detail::readVerified(path, &crc);
        }
        return py::make_tuple(py::bytes(payload), crc);
      },
      "path"_a,
      "(payload, crc): the content of path after its header, length and CRC-64 were checked; "
      "CheckpointError otherwise.");
  // The C++ CheckpointLock itself: one flock per path and process, released
  // when the object goes (or the process ends); a fork()ed copy holds nothing.
  py::class_<CheckpointLock>(m, "_CheckpointLock",
                             "The advisory lock <path>.lock of a checkpoint path (C++ "
                             "CheckpointLock): CheckpointError naming the other process "
                             "while a live one holds it.")
      .def(py::init([](const std::string& path) {
             py::gil_scoped_release nogil;
             return std::make_unique<CheckpointLock>(path);
           }),
           "checkpoint_path"_a)
      .def_static("lock_path_of", &CheckpointLock::lockPathOf, "checkpoint_path"_a);
  // One write at a time, on a thread of its own; every wait without the GIL.
  py::class_<detail::CheckpointWriter>(m, "_CheckpointWriter",
                                       "The C++ Checkpoint's writer thread: start() waits for "
                                       "the previous write (raising its CheckpointError), then "
                                       "writes the payload durably while Python goes on.")
      .def(py::init<>())
      .def(
          "start",
          [](detail::CheckpointWriter& w, const std::string& path, const py::bytes& payload,
             std::int64_t step) {
            std::string bytes = payload;  // copied while the GIL is held
            py::gil_scoped_release nogil;
            w.start(path, std::move(bytes), step);
          },
          "path"_a, "payload"_a, "step"_a)
      .def(
          "wait",
          [](detail::CheckpointWriter& w) {
            py::gil_scoped_release nogil;
            w.wait();
          },
          "Waits for the last write; raises its CheckpointError (once).")
      .def("pending", &detail::CheckpointWriter::pending,
           "Whether a write is in flight or its failure waits to be collected.");
  m.def(
      "_note_resumed",
      [](const py::object& model, std::int64_t step, std::int64_t epoch, std::int64_t index,
         std::string path) {
        detail::noteResumed(viewOfPython(model),
                            detail::Resumed{step, BatchPosition{epoch, index}, std::move(path)});
      },
      "model"_a, "step"_a, "epoch"_a, "index"_a, "path"_a,
      "Tells model's Aggregator (made now or later) that the model holds checkpoint path's "
      "step and data position: it goes on from there (start_step 0, or that step).");
}

}  // namespace gradagg::python
