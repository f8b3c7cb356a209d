// The writer thread of a Checkpoint (and of its copies, and of gradagg.Checkpoint
// in Python): save() hands it a payload already serialised in memory, so the
// training thread pauses only for the copy; the file is written, fsync'ed and
// renamed (checkpoint/durable_file.h) while training goes on.
//
// One write at a time: start() first waits for the write before it, and
// rethrows that one's failure instead of starting (a failure is never lost,
// and never reported twice). wait() waits for the last write and rethrows its
// failure. The destructor waits too and prints a failure nobody collected to
// stderr. A fork while a write is in flight leaves the child without the thread
// (its copy of the object is never used there: workers never save).
#pragma once

#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

namespace gradagg::detail {

class CheckpointWriter {
 public:
  CheckpointWriter() = default;
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  ~CheckpointWriter();

  // Waits for the write in flight (rethrowing its CheckpointError), then
  // writes `payload` to `path` durably on a thread of its own. `step` names
  // the save in a failure's message.
  void start(const std::string& path, std::string payload, std::int64_t step);
  // Waits for the last write; rethrows its failure once.
  void wait();
  // Whether a write is in flight or a failure waits to be collected.
  bool pending();

 private:
  void joinLocked();  // with mutex_ held
  void startLocked(const std::string& path, std::string payload, std::int64_t step);

  std::mutex mutex_;
  std::thread thread_;
  std::exception_ptr failure_;  // written by the thread, read after join
};

}  // namespace gradagg::detail
