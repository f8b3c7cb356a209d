#include "checkpoint/checkpoint_writer.h"

#include <cstdio>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include <gradagg/checkpoint.h>

#include "checkpoint/durable_file.h"

namespace gradagg::detail {

CheckpointWriter::~CheckpointWriter() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s (nobody called Checkpoint::wait() to collect it)\n", e.what());
  } catch (...) {
  }
}

void CheckpointWriter::joinLocked() {
  if (thread_.joinable()) thread_.join();
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

void CheckpointWriter::start(const std::string& path, std::string payload, std::int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  joinLocked();
  try {
    startLocked(path, std::move(payload), step);
  } catch (const std::system_error& e) {  // no thread: this save is not written
    throw CheckpointError(fmt::format("gradagg: checkpoint {}: saving step {} failed: no writer "
                                      "thread: {}",
                                      path, step, e.what()),
                          path);
  }
}

void CheckpointWriter::startLocked(const std::string& path, std::string payload,
                                   std::int64_t step) {
  thread_ = std::thread([this, path, step, payload = std::move(payload)] {
    try {
      writeDurably(path, payload);
    } catch (const CheckpointError& e) {
      failure_ = std::make_exception_ptr(
          CheckpointError(fmt::format("{} (saving step {})", e.what(), step), e.path()));
    } catch (...) {
      failure_ = std::current_exception();
    }
  });
}

void CheckpointWriter::wait() {
  std::lock_guard<std::mutex> lock(mutex_);
  joinLocked();
}

bool CheckpointWriter::pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  return thread_.joinable() || failure_ != nullptr;
}

}  // namespace gradagg::detail
