// One rank of a Gloo process group (LibTorch's c10d::ProcessGroupGloo): the
// engine gradagg uses, or compares itself with, to combine gradients between
// processes that share no memory. Rendezvous goes through a c10d::FileStore;
// the collective is an in-place sum over every rank.
//
// Only this file's .cpp sees c10d and gloo headers, so a user of GlooPeer
// compiles against ATen's Tensor alone.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

namespace gradagg::bench {

class GlooPeer {
 public:
  struct Options {
    // File every rank opens for the rendezvous (c10d::FileStore): a path on a
    // file system all ranks see, fresh for each group (the caller removes it).
    std::string store_path;
    int rank = 0;
    int size = 1;
    // Address this rank's Gloo device binds to and advertises.
    std::string hostname = "127.0.0.1";
    // Deadline of the rendezvous and of every collective.
    std::chrono::milliseconds timeout{std::chrono::seconds(60)};
    // Gloo worker threads of the process group (PyTorch uses 2 per device).
    int threads = 2;
  };

  // Joins the group: blocks until all `size` ranks have joined. Throws on timeout.
  explicit GlooPeer(const Options& options);
  ~GlooPeer();
  GlooPeer(GlooPeer&&) noexcept;
  GlooPeer& operator=(GlooPeer&&) noexcept;
  GlooPeer(const GlooPeer&) = delete;
  GlooPeer& operator=(const GlooPeer&) = delete;

  // Replaces `t` (a contiguous dense CPU tensor) by its sum over all ranks; blocks until done.
  void allreduceSum(at::Tensor& t);
  // Returns once every rank has called it.
  void barrier();

  int rank() const noexcept;
  int size() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradagg::bench
