// The I/O engine: batches of positional writes and reads split into tasks and run on a thread pool.
//
// Writes are described as a file image: a region [start, end) of one file is the concatenation of
// sorted byte segments with zero-filled gaps. The engine cuts the region into task_bytes pieces on
// aligned boundaries; a direct-I/O piece is written straight from the source when one aligned
// segment covers it, otherwise it is gathered into a per-worker aligned bounce buffer. Buffered
// pieces go out with pwritev from the sources, no copy.
#pragma once

#include "file.hpp"
#include "thread_pool.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace fastdcp {

/// A page-aligned heap allocation (posix_memalign), freed on destruction.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  /// Allocates `nbytes` aligned to `alignment`; throws std::bad_alloc when it cannot.
  AlignedBuffer(size_t nbytes, size_t alignment);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  [[nodiscard]] std::byte* data() const { return data_; }
  [[nodiscard]] size_t size() const { return size_; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

/// Bytes placed at `offset` of a file image; `data == nullptr` means `size` zero bytes.
struct WriteSegment {
  int64_t offset;
  const std::byte* data;
  size_t size;
};

/// The region [start, end) of `file`, made of `segments` (sorted by offset, non-overlapping, inside
/// the region); gaps are zeros. Precondition: `start` is a multiple of kDirectAlign. When the file
/// is direct, the last piece is padded with zeros up to the next aligned boundary: the caller
/// truncates the file to its true size once the whole image is written.
struct WriteJob {
  File* file;
  int64_t start;
  int64_t end;
  std::vector<WriteSegment> segments;
};

/// Read `size` bytes at `offset` of `file` into `dest`. A file that ends early is an IoError.
struct ReadJob {
  File* file;
  int64_t offset;
  std::byte* dest;
  size_t size;
};

struct EngineStats {
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
  uint64_t write_tasks = 0;
  uint64_t read_tasks = 0;
  uint64_t bounce_bytes = 0;  // bytes that went through a bounce buffer
};

class Engine {
 public:
  /// `num_threads` I/O workers; `task_bytes` is the unit a request is split into (rounded up to a
  /// multiple of kDirectAlign, at least one block).
  Engine(int num_threads, size_t task_bytes);

  [[nodiscard]] int num_threads() const { return pool_.size(); }
  [[nodiscard]] size_t task_bytes() const { return task_bytes_; }
  [[nodiscard]] ThreadPool& pool() { return pool_; }

  /// Writes every job's region; blocks until all are written or the first error, which is thrown.
  /// Tasks of different jobs are interleaved (task 0 of every job, then task 1, ...), so concurrent
  /// workers write different files: tmpfs, buffered writes on ext4/xfs and NFS clients serialise
  /// the writers of one file on its inode lock. Precondition: every job starts block-aligned.
  void write(const std::vector<WriteJob>& jobs);
  /// Reads every job; blocks until done or the first error, which is thrown.
  void read(const std::vector<ReadJob>& jobs, bool use_direct);
  /// fsync (or fdatasync) every file in parallel.
  void sync(const std::vector<File*>& files, bool data_only);

  /// Counters since construction (approximate under concurrency is fine: updated under a lock).
  [[nodiscard]] EngineStats stats() const;

 private:
  std::byte* bounce(int worker_index);
  void write_piece(const WriteJob& job, int64_t piece_start, int64_t piece_end, int worker_index);
  void read_piece(const ReadJob& job, int64_t piece_start, int64_t piece_end, bool use_direct,
                  int worker_index);

  size_t task_bytes_;
  ThreadPool pool_;
  std::vector<AlignedBuffer> bounce_;  // one per worker, created on first use
  mutable std::mutex stats_mutex_;
  EngineStats stats_;
};

}  // namespace fastdcp
