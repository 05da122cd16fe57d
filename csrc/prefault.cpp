#include "prefault.hpp"

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace fastdcp {

#if defined(__linux__)
namespace {

// From <linux/mman.h> (Linux 5.14); older headers do not define it.
constexpr int kMadvPopulateWrite = 23;

size_t page_size()
{
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

/// Whether this kernel knows MADV_POPULATE_WRITE, asked once on a private page of our own: a
/// failure on the caller's range cannot tell an old kernel from a mapping that refuses (a
/// read-only or device mapping also gives EINVAL).
bool kernel_populates_writable()
{
  static const bool supported = [] {
    void* probe = mmap(nullptr, page_size(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (probe == MAP_FAILED) { return false; }
    const bool ok = madvise(probe, page_size(), kMadvPopulateWrite) == 0;
    munmap(probe, page_size());
    return ok;
  }();
  return supported;
}

}  // namespace
#endif

bool prefault_writable(void* dst, size_t n)
{
#if defined(__linux__)
  const size_t page = page_size();
  const auto begin = reinterpret_cast<uintptr_t>(dst);
  const uintptr_t first = (begin + page - 1) / page * page;  // whole pages only: round inward
  const uintptr_t last = (begin + n) / page * page;
  if (n == 0 || first >= last || !kernel_populates_writable()) { return false; }
  return madvise(reinterpret_cast<void*>(first), last - first, kMadvPopulateWrite) == 0;
#else
  (void)dst;
  (void)n;
  return false;
#endif
}

}  // namespace fastdcp
