// Tests of prefault_writable (csrc/prefault.cpp) on real mappings, with mincore telling which
// pages the kernel has. A plain program; from the repository root:
//   g++ -std=c++17 -O2 -I csrc tests/io/cpp/test_prefault.cpp csrc/prefault.cpp -o test_prefault
// It prints "N passed, M failed" and exits non-zero when anything failed.
#include "prefault.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

int g_passed = 0;
int g_failed = 0;

void check(bool ok, const char* what)
{
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::printf("FAILED: %s\n", what);
  }
}

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

/// Which of the `pages` pages from `base` are resident.
std::vector<bool> resident(unsigned char* base, size_t pages)
{
  std::vector<unsigned char> vec(pages);
  if (mincore(base, pages * kPage, vec.data()) != 0) { std::perror("mincore"); }
  std::vector<bool> out(pages);
  for (size_t i = 0; i < pages; ++i) { out[i] = vec[i] & 1; }
  return out;
}

unsigned char* fresh_mapping(size_t pages, int prot = PROT_READ | PROT_WRITE)
{
  void* p = mmap(nullptr, pages * kPage, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<unsigned char*>(p);
}

/// Whether this kernel has MADV_POPULATE_WRITE, asked directly (not through the unit under test).
bool kernel_has_populate_write()
{
  unsigned char* page = fresh_mapping(1);
  const bool ok = madvise(page, kPage, 23 /* MADV_POPULATE_WRITE */) == 0;
  munmap(page, kPage);
  return ok;
}

}  // namespace

int main()
{
  constexpr size_t kPages = 64;
  const bool supported = kernel_has_populate_write();
  if (!supported) { std::printf("note: this kernel has no MADV_POPULATE_WRITE: checking the fallback only\n"); }

  // A range from 100 bytes into page 1 to 100 bytes into page 11: pages 2..10 lie wholly inside
  // and are populated; the partly covered pages 1 and 11 and every page outside are not.
  unsigned char* base = fresh_mapping(kPages);
  check(base != nullptr, "mmap");
  const auto before = resident(base, kPages);
  bool none_before = true;
  for (size_t i = 0; i < kPages; ++i) { none_before = none_before && !before[i]; }
  check(none_before, "a fresh mapping has no resident page");
  const bool populated = fastdcp::prefault_writable(base + kPage + 100, 10 * kPage);
  check(populated == supported, "returns whether the kernel populated the range");
  const auto after = resident(base, kPages);
  bool as_expected = true;
  for (size_t i = 0; i < kPages; ++i) { as_expected = as_expected && after[i] == (supported && i >= 2 && i <= 10); }
  check(as_expected, "exactly the whole pages inside the range became resident");
  bool zero = true;  // read only these pages: reading a page maps it (mincore would see it)
  for (size_t i = 2 * kPage; i < 11 * kPage; ++i) { zero = zero && base[i] == 0; }
  check(zero, "populated pages read as zero, like any new page");

  // Bytes already written stay: a page holding data, inside a populated range, keeps it.
  std::memset(base + 20 * kPage, 0x5A, kPage);
  check(fastdcp::prefault_writable(base + 20 * kPage, 5 * kPage) == supported, "populate over a written page");
  bool kept = true;
  for (size_t i = 0; i < kPage; ++i) { kept = kept && base[20 * kPage + i] == 0x5A; }
  check(kept, "a page already written keeps its bytes");

  // No whole page in the range: nothing to ask, nothing populated.
  check(!fastdcp::prefault_writable(base + 40 * kPage + 1, kPage), "a page's worth off the boundary has no whole page");
  check(!fastdcp::prefault_writable(base + 41 * kPage, 0), "an empty range");
  const auto untouched = resident(base, kPages);
  check(!untouched[40] && !untouched[41], "ranges without a whole page populate nothing");
  munmap(base, kPages * kPage);

  // A mapping the kernel refuses (read-only) gives false, and does not turn prefaulting off for
  // the next, writable, range.
  unsigned char* read_only = fresh_mapping(4, PROT_READ);
  check(!fastdcp::prefault_writable(read_only, 4 * kPage), "a read-only mapping is refused");
  munmap(read_only, 4 * kPage);
  unsigned char* again = fresh_mapping(4);
  check(fastdcp::prefault_writable(again, 4 * kPage) == supported, "a refusal does not turn prefaulting off");
  const auto again_resident = resident(again, 4);
  check(again_resident[0] == supported && again_resident[3] == supported, "the writable range was populated");
  munmap(again, 4 * kPage);

  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
