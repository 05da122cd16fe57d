#include "engine.hpp"

#include "io_error.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

namespace fastdcp {
namespace {

int64_t align_down(int64_t x) { return x / static_cast<int64_t>(kDirectAlign) * static_cast<int64_t>(kDirectAlign); }
int64_t align_up(int64_t x) { return align_down(x + static_cast<int64_t>(kDirectAlign) - 1); }
bool is_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kDirectAlign == 0; }

// Zero bytes for gaps in buffered pwritev; gaps are short (zip padding), longer ones repeat it.
alignas(kDirectAlign) const std::byte kZeros[kDirectAlign * 16] = {};

}  // namespace

AlignedBuffer::AlignedBuffer(size_t nbytes, size_t alignment) : size_(nbytes)
{
  void* p = nullptr;
  if (nbytes > 0 && ::posix_memalign(&p, alignment, nbytes) != 0) { throw std::bad_alloc(); }
  data_ = static_cast<std::byte*>(p);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept : data_(other.data_), size_(other.size_)
{
  other.data_ = nullptr;
  other.size_ = 0;
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept
{
  if (this != &other) {
    std::free(data_);
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

Engine::Engine(int num_threads, size_t task_bytes)
  : task_bytes_(static_cast<size_t>(std::max<int64_t>(
      static_cast<int64_t>(kDirectAlign), align_up(static_cast<int64_t>(task_bytes))))),
    pool_(num_threads),
    bounce_(static_cast<size_t>(pool_.size()))
{
}

std::byte* Engine::bounce(int worker_index)
{
  auto& buf = bounce_[static_cast<size_t>(worker_index)];
  // A read piece may straddle one extra block on each side of task_bytes.
  if (buf.data() == nullptr) { buf = AlignedBuffer(task_bytes_ + 2 * kDirectAlign, kDirectAlign); }
  return buf.data();
}

EngineStats Engine::stats() const
{
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return stats_;
}

void Engine::write(const std::vector<WriteJob>& jobs)
{
  struct Piece {
    size_t job;
    int64_t start, end;
  };
  const auto step = static_cast<int64_t>(task_bytes_);
  size_t most_pieces = 0;
  size_t total_pieces = 0;
  for (const auto& job : jobs) {
    if (job.start % static_cast<int64_t>(kDirectAlign) != 0) {
      throw std::invalid_argument("write job start " + std::to_string(job.start) +
                                  " is not aligned for '" + job.file->path() + "'");
    }
    const size_t n = job.end > job.start ? static_cast<size_t>((job.end - job.start + step - 1) / step) : 0;
    most_pieces = std::max(most_pieces, n);
    total_pieces += n;
  }
  // Round-robin over jobs (see engine.hpp): workers taking tasks in order land on different files.
  std::vector<Piece> pieces;
  pieces.reserve(total_pieces);
  for (size_t k = 0; k < most_pieces; ++k) {
    for (size_t j = 0; j < jobs.size(); ++j) {
      const int64_t s = jobs[j].start + static_cast<int64_t>(k) * step;
      if (s < jobs[j].end) { pieces.push_back({j, s, std::min(jobs[j].end, s + step)}); }
    }
  }
  pool_.run_batch(pieces.size(), [&](size_t i, int worker) {
    write_piece(jobs[pieces[i].job], pieces[i].start, pieces[i].end, worker);
  });
}

void Engine::write_piece(const WriteJob& job, int64_t piece_start, int64_t piece_end, int worker_index)
{
  const auto& segs = job.segments;
  // First segment that ends after piece_start.
  auto it = std::partition_point(segs.begin(), segs.end(), [&](const WriteSegment& s) {
    return s.offset + static_cast<int64_t>(s.size) <= piece_start;
  });
  const bool direct = job.file->direct();
  const int64_t padded_end = direct ? align_up(piece_end) : piece_end;
  const size_t length = static_cast<size_t>(padded_end - piece_start);

  // Zero copy for direct I/O: one segment with suitably aligned memory covers the whole piece.
  if (direct && it != segs.end() && it->data != nullptr && it->offset <= piece_start &&
      it->offset + static_cast<int64_t>(it->size) >= padded_end &&
      is_aligned(it->data + (piece_start - it->offset))) {
    struct iovec v{const_cast<std::byte*>(it->data + (piece_start - it->offset)), length};
    job.file->write_all(&v, 1, piece_start, true);
  } else if (direct) {
    std::byte* buf = bounce(worker_index);
    std::memset(buf, 0, length);
    for (auto s = it; s != segs.end() && s->offset < piece_end; ++s) {
      int64_t from = std::max(piece_start, s->offset);
      int64_t to = std::min(piece_end, s->offset + static_cast<int64_t>(s->size));
      if (s->data != nullptr && to > from) {
        std::memcpy(buf + (from - piece_start), s->data + (from - s->offset), static_cast<size_t>(to - from));
      }
    }
    struct iovec v{buf, length};
    job.file->write_all(&v, 1, piece_start, true);
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.bounce_bytes += length;
  } else {
    std::vector<struct iovec> iov;
    int64_t cursor = piece_start;
    auto add_zeros = [&](int64_t n) {
      while (n > 0) {
        size_t take = std::min<size_t>(static_cast<size_t>(n), sizeof(kZeros));
        iov.push_back({const_cast<std::byte*>(kZeros), take});
        n -= static_cast<int64_t>(take);
      }
    };
    for (auto s = it; s != segs.end() && s->offset < piece_end; ++s) {
      int64_t from = std::max(piece_start, s->offset);
      int64_t to = std::min(piece_end, s->offset + static_cast<int64_t>(s->size));
      if (to <= from) { continue; }
      add_zeros(from - cursor);
      if (s->data != nullptr) {
        iov.push_back({const_cast<std::byte*>(s->data + (from - s->offset)), static_cast<size_t>(to - from)});
      } else {
        add_zeros(to - from);
      }
      cursor = to;
    }
    add_zeros(piece_end - cursor);
    job.file->write_all(iov.data(), static_cast<int>(iov.size()), piece_start, false);
  }
  std::lock_guard<std::mutex> lock(stats_mutex_);
  stats_.bytes_written += static_cast<uint64_t>(piece_end - piece_start);
  stats_.write_tasks += 1;
}

void Engine::read(const std::vector<ReadJob>& jobs, bool use_direct)
{
  struct Piece {
    size_t job;
    int64_t start, end;
  };
  std::vector<Piece> pieces;
  const auto task = static_cast<int64_t>(task_bytes_);
  for (size_t j = 0; j < jobs.size(); ++j) {
    const auto& job = jobs[j];
    const int64_t end = job.offset + static_cast<int64_t>(job.size);
    // Cut on task-aligned file offsets so direct pieces stay within one bounce buffer.
    for (int64_t s = job.offset; s < end;) {
      int64_t e = std::min(end, (s / task + 1) * task);
      pieces.push_back({j, s, e});
      s = e;
    }
  }
  pool_.run_batch(pieces.size(), [&](size_t i, int worker) {
    read_piece(jobs[pieces[i].job], pieces[i].start, pieces[i].end, use_direct, worker);
  });
}

void Engine::read_piece(const ReadJob& job, int64_t piece_start, int64_t piece_end, bool use_direct,
                        int worker_index)
{
  std::byte* dest = job.dest + (piece_start - job.offset);
  const size_t want = static_cast<size_t>(piece_end - piece_start);
  const bool direct = use_direct && job.file->direct();
  size_t got;
  if (!direct || (is_aligned(dest) && piece_start % static_cast<int64_t>(kDirectAlign) == 0 &&
                  want % kDirectAlign == 0)) {
    got = job.file->read_upto(dest, want, piece_start, direct);
  } else {
    const int64_t a0 = align_down(piece_start);
    const int64_t a1 = align_up(piece_end);
    std::byte* buf = bounce(worker_index);
    size_t read = job.file->read_upto(buf, static_cast<size_t>(a1 - a0), a0, true);
    size_t skip = static_cast<size_t>(piece_start - a0);
    got = read > skip ? std::min(want, read - skip) : 0;
    std::memcpy(dest, buf + skip, got);
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.bounce_bytes += static_cast<uint64_t>(a1 - a0);
  }
  if (got != want) {
    throw IoError("pread", job.file->path(), piece_start, want, 0,
                  "only " + std::to_string(got) + " of " + std::to_string(want) +
                    " bytes exist there: the file is shorter than the checkpoint metadata says (truncated file?)");
  }
  std::lock_guard<std::mutex> lock(stats_mutex_);
  stats_.bytes_read += want;
  stats_.read_tasks += 1;
}

void Engine::sync(const std::vector<File*>& files, bool data_only)
{
  pool_.run_batch(files.size(), [&](size_t i, int) { files[i]->sync(data_only); });
}

}  // namespace fastdcp
