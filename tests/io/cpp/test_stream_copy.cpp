// stream_copy against memcpy: lengths around the streaming threshold and the 64-byte line, every
// combination of misaligned source and destination, and guard bytes on both sides of the
// destination that must stay untouched (the unaligned head and the tail go through memcpy).
// forward_copy the same way, with source and destination at equal page offsets (its own loop) and
// at different ones (memcpy).
#include "paged_buffer.hpp"
#include "stream_copy.hpp"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

namespace {

int passed = 0, failed = 0;

void check(bool ok, const char* what, size_t n, size_t src_offset, size_t dst_offset)
{
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAILED: %s (n=%zu, src offset %zu, dst offset %zu)\n", what, n, src_offset, dst_offset);
  }
}


void test_forward_copy()
{
  constexpr unsigned char kSentinel = 0x5A;
  const size_t min = fastdcp::kForwardCopyMinBytes;
  const size_t sizes[] = {0, 1, 63, min - 1, min, min + 1, min + 63, 4096, 4096 + 37, (size_t{1} << 20) + 5};
  // Equal page offsets take the forward loop (head lengths 0, 1, 63 and 64 - 13 before the first
  // line); unequal ones go to memcpy, 4 KiB apart or not.
  const std::pair<size_t, size_t> offsets[] = {{0, 0},    {1, 1},       {63, 63},       {13, 13},
                                               {4095, 4095}, {0, 2048}, {64, 0},        {7, 3}};
  for (size_t n : sizes) {
    for (const auto& [src_offset, dst_offset] : offsets) {
      PagedBuffer src(n, src_offset, 0);
      for (size_t i = 0; i < n; ++i) {
        src.data[i] = static_cast<unsigned char>(i * 151 + 11 + (i >> 11));
      }
      PagedBuffer dst(n, dst_offset, kSentinel);
      fastdcp::forward_copy(dst.data, src.data, n);
      check(n == 0 || std::memcmp(dst.data, src.data, n) == 0, "forward_copy: bytes equal", n,
            src_offset, dst_offset);
      check(dst.guards_intact(kSentinel), "forward_copy: bytes outside the destination untouched", n,
            src_offset, dst_offset);
    }
  }
}

}  // namespace

int main()
{
  test_forward_copy();
  constexpr size_t kGuard = 128;
  constexpr unsigned char kSentinel = 0xA5;
  const size_t min = fastdcp::kStreamCopyMinBytes;
  for (size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{4097}, min - 1, min, min + 1,
                   min + 63, min + 64, (size_t{1} << 20) + 37, (size_t{3} << 20) + 4099}) {
    for (size_t src_offset : {size_t{0}, size_t{1}, size_t{7}, size_t{64}}) {
      for (size_t dst_offset : {size_t{0}, size_t{1}, size_t{13}, size_t{63}}) {
        std::vector<unsigned char> src(n + src_offset + 64);
        for (size_t i = 0; i < src.size(); ++i) {
          src[i] = static_cast<unsigned char>(i * 151 + 11 + (i >> 11));
        }
        // 64 spare bytes let the destination start at any offset from a 64-byte line.
        std::vector<unsigned char> dst(kGuard + 64 + n + kGuard, kSentinel);
        const size_t line_pad = (64 - reinterpret_cast<std::uintptr_t>(dst.data() + kGuard) % 64) % 64;
        unsigned char* out = dst.data() + kGuard + (line_pad + dst_offset) % 64;
        fastdcp::stream_copy(out, src.data() + src_offset, n);
        check(n == 0 || std::memcmp(out, src.data() + src_offset, n) == 0, "bytes equal", n, src_offset,
              dst_offset);
        bool guards_intact = true;
        for (unsigned char* p = dst.data(); p < out; ++p) { guards_intact &= *p == kSentinel; }
        for (unsigned char* p = out + n; p < dst.data() + dst.size(); ++p) { guards_intact &= *p == kSentinel; }
        check(guards_intact, "bytes outside the destination untouched", n, src_offset, dst_offset);
      }
    }
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
