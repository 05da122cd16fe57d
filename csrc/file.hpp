// An open checkpoint file: positional I/O that finishes short transfers, retries EINTR, and uses
// O_DIRECT when the filesystem allows it, falling back to buffered I/O per file when it does not.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <sys/uio.h>

namespace fastdcp {

/// Alignment of O_DIRECT offsets, lengths and buffers used throughout. 4096 covers every Linux
/// block device we target; a filesystem that needs more is used buffered.
constexpr size_t kDirectAlign = 4096;

enum class OpenMode { kRead, kWriteTruncate };

/// True when `path` (an existing file or directory) lives on a memory-backed filesystem (tmpfs,
/// ramfs), where O_DIRECT buys nothing and costs a bounce copy. False when unknown.
bool on_memory_filesystem(const std::string& path);

/// Test hooks read from the environment when a file is opened, so tests can exercise fallbacks and
/// short-transfer loops on filesystems that would never produce them:
///   FASTDCP_TEST_DIRECT_EINVAL=open|io  pretend O_DIRECT is refused at open / at the first I/O
///   FASTDCP_TEST_MAX_IO_BYTES=N         cap every read/write syscall to N bytes (short transfers)
struct FileTestHooks {
  bool einval_at_open = false;
  bool einval_at_io = false;
  size_t max_io_bytes = 0;  // 0 = no cap
  static FileTestHooks from_environment();
};

class File {
 public:
  /// Opens `path`. kWriteTruncate creates or truncates it (mode 0644). With `want_direct`, a second
  /// descriptor with O_DIRECT is opened; if that open fails with EINVAL (filesystem refuses direct
  /// I/O, e.g. tmpfs on older kernels) the file silently stays buffered. Throws IoError otherwise.
  File(std::string path, OpenMode mode, bool want_direct);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  [[nodiscard]] const std::string& path() const { return path_; }
  /// True while direct I/O is in use for this file (may turn false after a refused first I/O).
  [[nodiscard]] bool direct() const { return direct_fd_ >= 0 && direct_ok_.load(); }
  [[nodiscard]] bool is_open() const { return fd_ >= 0; }

  /// Writes all `iovcnt` buffers back to back at `offset` (pwritev), finishing short writes.
  /// With `use_direct` the caller guarantees kDirectAlign alignment of offset, lengths and buffers;
  /// if the kernel still answers EINVAL the file switches to buffered I/O for good and retries.
  void write_all(const struct iovec* iov, int iovcnt, int64_t offset, bool use_direct);

  /// Reads up to `nbytes` at `offset` into `buf`, finishing short reads; returns the bytes read,
  /// fewer only at end of file. Alignment contract for `use_direct` as in write_all.
  size_t read_upto(void* buf, size_t nbytes, int64_t offset, bool use_direct);

  /// Sets the file size (ftruncate).
  void truncate(int64_t size);
  /// Reserves blocks for the first `size` bytes and makes the file at least that long (fallocate,
  /// or ftruncate where fallocate is unsupported), so that later writes never extend the file:
  /// ext4 serialises extending O_DIRECT writes. Throws IoError on ENOSPC.
  void allocate(int64_t size);
  /// fsync, or fdatasync when `data_only`.
  void sync(bool data_only);
  /// Current size from fstat.
  [[nodiscard]] int64_t size() const;
  /// Closes both descriptors; reports a close error (which can carry a deferred write error).
  void close();

 private:
  void fall_back_to_buffered();
  [[nodiscard]] size_t cap(size_t nbytes) const;

  std::string path_;
  int fd_ = -1;         // buffered descriptor, always open
  int direct_fd_ = -1;  // O_DIRECT descriptor, or -1
  std::atomic<bool> direct_ok_{true};
  FileTestHooks hooks_;
  std::atomic<bool> first_direct_io_{true};
};

}  // namespace fastdcp
