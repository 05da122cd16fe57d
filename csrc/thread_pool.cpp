#include "thread_pool.hpp"

#include <algorithm>
#include <cstdio>
#include <pthread.h>
#include <unistd.h>

namespace fastdcp {

// A batch is owned by the caller of run_batch (on its stack); workers claim indices under the mutex
// and report completion through `finished`. The caller removes the batch from the queue once all
// indices are claimed, so no worker touches it after the caller returns.
struct ThreadPool::Batch {
  size_t num_tasks = 0;
  size_t next = 0;      // next unclaimed index
  size_t finished = 0;  // tasks run or skipped
  bool failed = false;
  std::exception_ptr error;
  const std::function<void(size_t, int)>* task = nullptr;
  std::condition_variable done;
};

ThreadPool::ThreadPool(int num_threads) : owner_pid_(::getpid())
{
  num_threads = std::max(1, num_threads);
  workers_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) {
    workers_.emplace_back([this, i] {
      // Named so that tools (top -H, py-spy) and tests can tell fastdcp's threads apart.
      char name[16];
      std::snprintf(name, sizeof(name), "fastdcp-io-%d", i);
      ::pthread_setname_np(::pthread_self(), name);
      worker_loop(i);
    });
  }
}

ThreadPool::~ThreadPool()
{
  if (::getpid() != owner_pid_) {
    // A forked child has the pool's memory but none of its threads: joining them is undefined and
    // destroying joinable std::threads terminates. Leak the handles instead.
    new std::vector<std::thread>(std::move(workers_));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& w : workers_) {
    w.join();
  }
}

void ThreadPool::run_batch(size_t num_tasks, const std::function<void(size_t, int)>& task)
{
  if (num_tasks == 0) { return; }
  Batch batch;
  batch.num_tasks = num_tasks;
  batch.task = &task;
  std::unique_lock<std::mutex> lock(mutex_);
  queue_.push_back(&batch);
  work_ready_.notify_all();
  batch.done.wait(lock, [&] { return batch.finished == batch.num_tasks; });
  if (batch.error) { std::rethrow_exception(batch.error); }
}

void ThreadPool::worker_loop(int worker_index)
{
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) { return; }  // stopping and nothing left
    Batch* batch = queue_.front();
    size_t index = batch->next++;
    if (batch->next == batch->num_tasks) { queue_.erase(queue_.begin()); }
    bool skip = batch->failed;
    lock.unlock();
    std::exception_ptr error;
    if (!skip) {
      try {
        (*batch->task)(index, worker_index);
      } catch (...) {
        error = std::current_exception();
      }
    }
    lock.lock();
    if (error && !batch->failed) {
      batch->failed = true;
      batch->error = error;
    }
    if (++batch->finished == batch->num_tasks) { batch->done.notify_all(); }
  }
}

}  // namespace fastdcp
