#include "file.hpp"

#include "io_error.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <climits>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <vector>

namespace fastdcp {

IoError::IoError(std::string op, std::string path, int64_t offset, size_t nbytes, int errno_value,
                 std::string detail)
  : std::runtime_error(op + " failed on '" + path + "' at offset " + std::to_string(offset) + " (" +
                       std::to_string(nbytes) +
                       " bytes): " + (errno_value != 0 ? std::strerror(errno_value) : detail)),
    path_(std::move(path)),
    errno_value_(errno_value)
{
}

bool on_memory_filesystem(const std::string& path)
{
  constexpr long kTmpfsMagic = 0x01021994;
  constexpr long kRamfsMagic = 0x858458f6;
  struct statfs st {};
  if (::statfs(path.c_str(), &st) != 0) { return false; }
  return static_cast<long>(st.f_type) == kTmpfsMagic || static_cast<long>(st.f_type) == kRamfsMagic;
}

namespace {

/// Whether mincore tells the truth about `st`'s pages to this process. Since Linux 5.0 it reports
/// page-cache residency of a file mapping only to its owner or to a process that may write it
/// (else every page reads as resident); root is assumed to hold CAP_FOWNER.
bool mincore_reveals_cache(const std::string& path, const struct stat& st)
{
  const uid_t me = ::geteuid();
  return me == 0 || st.st_uid == me || ::faccessat(AT_FDCWD, path.c_str(), W_OK, AT_EACCESS) == 0;
}

/// Counts the resident pages among `npages` pages starting at page `first` of `map`; -1 when
/// mincore fails.
int64_t resident_pages(const std::byte* map, size_t page, size_t first, size_t npages,
                       std::vector<unsigned char>& vec)
{
  vec.assign(npages, 0);
  if (::mincore(const_cast<std::byte*>(map) + first * page, npages * page, vec.data()) != 0) {
    return -1;
  }
  int64_t resident = 0;
  for (unsigned char v : vec) { resident += v & 1; }
  return resident;
}

}  // namespace

double page_cache_resident_fraction(const std::string& path, size_t max_pages)
{
  max_pages = std::max<size_t>(max_pages, 1);
  constexpr double kUnknown = -1.0;
  struct stat st {};
  // stat first: a FIFO or device is never opened (opening a FIFO blocks until a writer comes).
  if (::stat(path.c_str(), &st) != 0) { throw IoError("stat", path, 0, 0, errno); }
  if (!S_ISREG(st.st_mode)) { return kUnknown; }
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) { throw IoError("open for reading", path, 0, 0, errno); }
  // The file that was opened (the path may have been replaced since the stat above).
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError("fstat", path, 0, 0, err);
  }
  if (!S_ISREG(st.st_mode) || !mincore_reveals_cache(path, st)) {
    ::close(fd);
    return kUnknown;
  }
  if (st.st_size == 0) {
    ::close(fd);
    return 1.0;
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size > static_cast<uint64_t>(SIZE_MAX)) {  // cannot be mapped (32-bit)
    ::close(fd);
    return kUnknown;
  }
  void* mapped = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file
  if (mapped == MAP_FAILED) { return kUnknown; }
  const auto* map = static_cast<const std::byte*>(mapped);
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t npages = static_cast<size_t>((size + page - 1) / page);
  std::vector<unsigned char> vec;
  int64_t resident = 0;
  size_t checked = 0;
  if (npages <= max_pages) {
    resident = resident_pages(map, page, 0, npages, vec);
    checked = npages;
  } else {
    // Windows spread evenly from the first page to the last: a partly cached file (read up to
    // somewhere, or its tail evicted) is judged by the share of windows on each side.
    // Windows of at least kResidencyMinWindow pages: one mincore call costs ~0.6 us, as much as
    // ~20 page lookups.
    const size_t windows = std::clamp<size_t>(max_pages / kResidencyMinWindow, 1, kResidencyWindows);
    const size_t window = max_pages / windows;
    const size_t last_start = npages - window;
    for (size_t w = 0; w < windows && resident >= 0; ++w) {
      const size_t first = windows == 1 ? 0 : last_start * w / (windows - 1);  // no overflow below 2^58 pages
      const int64_t got = resident_pages(map, page, first, window, vec);
      resident = got < 0 ? -1 : resident + got;
      checked += window;
    }
  }
  ::munmap(mapped, static_cast<size_t>(size));
  if (resident < 0) { return kUnknown; }
  return static_cast<double>(resident) / static_cast<double>(checked);
}

FileTestHooks FileTestHooks::from_environment()
{
  FileTestHooks hooks;
  if (const char* v = std::getenv("FASTDCP_TEST_DIRECT_EINVAL")) {
    hooks.einval_at_open = std::strcmp(v, "open") == 0;
    hooks.einval_at_io = std::strcmp(v, "io") == 0;
  }
  if (const char* v = std::getenv("FASTDCP_TEST_MAX_IO_BYTES")) {
    hooks.max_io_bytes = static_cast<size_t>(std::strtoull(v, nullptr, 10));
  }
  return hooks;
}

File::File(std::string path, OpenMode mode, bool want_direct)
  : path_(std::move(path)), hooks_(FileTestHooks::from_environment())
{
  open_descriptors(path_, mode, want_direct);
}

File::File(std::string path, const std::string& open_path, OpenMode mode, bool want_direct, ReopenTag)
  : path_(std::move(path)), hooks_(FileTestHooks::from_environment())
{
  open_descriptors(open_path, mode, want_direct);
}

std::shared_ptr<File> File::reopen(bool want_direct) const
{
  if (fd_ < 0) { throw IoError("reopen", path_, 0, 0, EBADF); }
  // /proc/self/fd/N names the open file itself, not the path it was opened by: opening it reaches
  // the same inode even after the path was unlinked or now names another file.
  return std::shared_ptr<File>(
    new File(path_, "/proc/self/fd/" + std::to_string(fd_), OpenMode::kRead, want_direct, ReopenTag{}));
}

void File::open_descriptors(const std::string& open_path, OpenMode mode, bool want_direct)
{
  int flags = O_CLOEXEC | (mode == OpenMode::kRead ? O_RDONLY : (O_WRONLY | O_CREAT | O_TRUNC));
  do {
    fd_ = ::open(open_path.c_str(), flags, 0644);
  } while (fd_ < 0 && errno == EINTR);
  if (fd_ < 0) {
    throw IoError(mode == OpenMode::kRead ? "open for reading" : "open for writing", path_, 0, 0,
                  errno);
  }
  if (!want_direct) { return; }
  int direct_flags = O_CLOEXEC | O_DIRECT | (mode == OpenMode::kRead ? O_RDONLY : O_WRONLY);
  if (hooks_.einval_at_open) {
    errno = EINVAL;
  } else {
    direct_fd_ = ::open(open_path.c_str(), direct_flags);
  }
  if (direct_fd_ < 0) {
    int err = errno;
    // EINVAL: the filesystem refuses O_DIRECT; stay buffered. Anything else is a real error.
    if (err != EINVAL) {
      ::close(fd_);
      fd_ = -1;
      throw IoError("open with O_DIRECT", path_, 0, 0, err);
    }
    direct_fd_ = -1;
  }
}

File::~File()
{
  if (direct_fd_ >= 0) { ::close(direct_fd_); }
  if (fd_ >= 0) { ::close(fd_); }
}

size_t File::cap(size_t nbytes) const
{
  return hooks_.max_io_bytes > 0 ? std::min(nbytes, hooks_.max_io_bytes) : nbytes;
}

void File::fall_back_to_buffered() { direct_ok_.store(false); }

void File::write_all(const struct iovec* iov_in, int iovcnt, int64_t offset, bool use_direct)
{
  std::vector<struct iovec> iov(iov_in, iov_in + iovcnt);
  size_t first = 0;
  size_t total = 0;
  for (const auto& v : iov) { total += v.iov_len; }
  const int64_t start = offset;
  while (first < iov.size()) {
    if (iov[first].iov_len == 0) {
      ++first;
      continue;
    }
    const bool direct_now = use_direct && direct();
    const int fd = direct_now ? direct_fd_ : fd_;
    // A test cap limits one syscall to its first max_io_bytes bytes; a direct transfer keeps whole
    // aligned blocks so the capped call is still legal.
    size_t limit = cap(SIZE_MAX);
    if (direct_now && limit != SIZE_MAX) { limit = std::max(kDirectAlign, limit / kDirectAlign * kDirectAlign); }
    std::vector<struct iovec> call;
    size_t in_call = 0;
    for (size_t i = first; i < iov.size() && in_call < limit && call.size() < static_cast<size_t>(IOV_MAX); ++i) {
      size_t take = std::min(iov[i].iov_len, limit - in_call);
      call.push_back({iov[i].iov_base, take});
      in_call += take;
    }
    ssize_t n;
    if (direct_now && hooks_.einval_at_io && first_direct_io_.load()) {
      n = -1;
      errno = EINVAL;
    } else {
      n = ::pwritev(fd, call.data(), static_cast<int>(call.size()), offset);
    }
    if (n < 0) {
      int err = errno;
      if (err == EINTR) { continue; }
      if (err == EINVAL && direct_now) {
        // The filesystem accepted O_DIRECT at open but refuses it for I/O: buffered from now on.
        fall_back_to_buffered();
        continue;
      }
      throw IoError("pwrite", path_, offset, total - static_cast<size_t>(offset - start), err);
    }
    if (direct_now) { first_direct_io_.store(false); }
    if (n == 0) { throw IoError("pwrite", path_, offset, in_call, 0, "wrote 0 bytes"); }
    offset += n;
    size_t left = static_cast<size_t>(n);
    while (left > 0 && first < iov.size()) {
      size_t step = std::min(left, iov[first].iov_len);
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + step;
      iov[first].iov_len -= step;
      left -= step;
      if (iov[first].iov_len == 0) { ++first; }
    }
  }
}

size_t File::read_upto(void* buf, size_t nbytes, int64_t offset, bool use_direct)
{
  size_t done = 0;
  while (done < nbytes) {
    const bool direct_now = use_direct && direct();
    const int fd = direct_now ? direct_fd_ : fd_;
    size_t want = cap(nbytes - done);
    if (direct_now && want != nbytes - done) { want = std::max(kDirectAlign, want / kDirectAlign * kDirectAlign); }
    ssize_t n;
    if (direct_now && hooks_.einval_at_io && first_direct_io_.load()) {
      n = -1;
      errno = EINVAL;
    } else {
      n = ::pread(fd, static_cast<char*>(buf) + done, want, offset + static_cast<int64_t>(done));
    }
    if (n < 0) {
      int err = errno;
      if (err == EINTR) { continue; }
      if (err == EINVAL && direct_now) {
        fall_back_to_buffered();
        continue;
      }
      throw IoError("pread", path_, offset + static_cast<int64_t>(done), nbytes - done, err);
    }
    if (direct_now) { first_direct_io_.store(false); }
    if (n == 0) { break; }  // end of file
    done += static_cast<size_t>(n);
    // A direct read that returns a partial block has reached end of file.
    if (direct_now && static_cast<size_t>(n) % kDirectAlign != 0) { break; }
  }
  return done;
}

void File::truncate(int64_t size)
{
  int rc;
  do {
    rc = ::ftruncate(fd_, size);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) { throw IoError("ftruncate", path_, size, 0, errno); }
}

void File::allocate(int64_t size)
{
  if (size <= 0) { return; }
  int rc;
  do {
    rc = ::fallocate(fd_, 0, 0, size);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) { return; }
  if (errno == ENOSPC) { throw IoError("fallocate", path_, 0, static_cast<size_t>(size), errno); }
  // No fallocate here: still set the size, so that parallel writes are overwrites rather than
  // appends (ext4 serialises O_DIRECT writes that extend a file).
  if (this->size() < size) { truncate(size); }
}

void File::sync(bool data_only)
{
  int rc;
  do {
    rc = data_only ? ::fdatasync(fd_) : ::fsync(fd_);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) { throw IoError(data_only ? "fdatasync" : "fsync", path_, 0, 0, errno); }
}

int64_t File::size() const
{
  struct stat st {};
  if (::fstat(fd_, &st) != 0) { throw IoError("fstat", path_, 0, 0, errno); }
  return static_cast<int64_t>(st.st_size);
}

void File::close()
{
  int err = 0;
  if (direct_fd_ >= 0) {
    if (::close(direct_fd_) != 0 && errno != EINTR) { err = errno; }
    direct_fd_ = -1;
  }
  if (fd_ >= 0) {
    if (::close(fd_) != 0 && errno != EINTR && err == 0) { err = errno; }
    fd_ = -1;
  }
  if (err != 0) { throw IoError("close", path_, 0, 0, err); }
}

}  // namespace fastdcp
