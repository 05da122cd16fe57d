// An open checkpoint file: positional I/O that finishes short transfers, retries EINTR, and uses
// O_DIRECT when the filesystem allows it, falling back to buffered I/O per file when it does not.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
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

/// The default bound on the pages page_cache_resident_fraction checks in one file, and the most
/// windows it spreads them over. Each checked page costs one page-cache lookup, ~20-30 ns (a 1 GiB
/// file checked whole would cost ~8 ms, 6% of reading it from the page cache), hence sampling.
constexpr size_t kResidencyPages = 4096;
constexpr size_t kResidencyWindows = 64;
constexpr size_t kResidencyMinWindow = 16;

/// The fraction of `path`'s pages that are in the page cache, in [0, 1]: mincore(2) on a
/// read-only MAP_SHARED mapping, so no page is touched (nothing is read, faulted in or evicted).
/// At most `max_pages` pages are checked whatever the file's size: a file of up to that many
/// pages (16 MiB at the default and 4 KiB pages) is checked whole, a larger one (a 100 GiB file
/// alike) in windows of equal size (at most kResidencyWindows, of at least kResidencyMinWindow
/// pages where max_pages allows) spread evenly from its first page to its last. The cost is one
/// stat, open, mmap and munmap, one mincore per window and at most `max_pages` lookups: measured
/// ~150 us for a cached 1 GiB file at the default, ~6 us per small file.
/// Preconditions: max_pages >= 1 (0 is taken as 1); `path` should name a regular file.
/// Returns 1.0 for an empty file (nothing left to read from the disk).
/// Returns -1.0 (unknown) where the kernel cannot tell: not a regular file (FIFOs and devices are
/// never opened), mmap or mincore refused (a filesystem without mmap, e.g. FUSE in direct_io
/// mode, which bypasses the page cache anyway), or a file the caller neither owns nor may write,
/// for which Linux >= 5.0 reports every page as resident (it closes a cache side channel); root
/// is taken as allowed (CAP_FOWNER), and where this check errs the answer errs towards resident.
/// Throws IoError when the file cannot be stat'ed or opened (a missing file: ENOENT), as opening
/// it for reading would.
double page_cache_resident_fraction(const std::string& path, size_t max_pages = kResidencyPages);

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

  /// This file opened again for reading, with or without O_DIRECT as the constructor would open
  /// it: the same inode, reached through /proc/self/fd, even when its path has since been unlinked
  /// or replaced by another file (a load keeps reading the save whose files it pinned). This file
  /// stays open. Preconditions: open, opened for reading (the new file is read-only). Throws
  /// IoError when the reopen fails (e.g. no /proc mounted).
  [[nodiscard]] std::shared_ptr<File> reopen(bool want_direct) const;
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
  struct ReopenTag {};
  File(std::string path, const std::string& open_path, OpenMode mode, bool want_direct, ReopenTag);
  void open_descriptors(const std::string& open_path, OpenMode mode, bool want_direct);
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
