// A fixed-size worker pool for blocking I/O and copy tasks.
//
// Work is submitted as a batch of N independent task indices; the caller blocks until every task
// of the batch has run (or was skipped after the first failure). The first exception thrown by a
// task is rethrown in the caller. No Python is touched from the workers.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fastdcp {

class ThreadPool {
 public:
  /// Starts `num_threads` workers (at least one), named `fastdcp-io-<i>` (Linux thread names).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// Number of worker threads.
  [[nodiscard]] int size() const { return static_cast<int>(workers_.size()); }

  /// Runs `task(i, worker_index)` for every i in [0, num_tasks) on the workers and waits for all.
  /// `worker_index` is in [0, size()) and lets a task use per-worker scratch memory.
  /// After the first task throws, tasks not yet started are skipped; that exception is rethrown
  /// here once the batch has drained. Safe to call from several threads at once (batches queue).
  void run_batch(size_t num_tasks, const std::function<void(size_t, int)>& task);

 private:
  struct Batch;
  void worker_loop(int worker_index);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::vector<Batch*> queue_;  // batches with tasks not yet claimed, oldest first
  bool stopping_ = false;
  int owner_pid_;  // the process that started the workers
};

}  // namespace fastdcp
