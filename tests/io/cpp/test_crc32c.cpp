// CRC-32C against a bit-by-bit reference: the standard check value, lengths around the 8-byte and
// interleaved-block boundaries, and chaining (crc of a+b == crc of b continued from crc of a).
#include "crc32c.hpp"

#include <cstdio>
#include <vector>

namespace {

uint32_t reference(const unsigned char* p, size_t n)
{
  uint32_t c = ~0u;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) { c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u))); }
  }
  return ~c;
}

int passed = 0, failed = 0;

void check(bool ok, const char* what, size_t n)
{
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAILED: %s (n=%zu)\n", what, n);
  }
}

}  // namespace

int main()
{
  check(fastdcp::crc32c("123456789", 9) == 0xE3069283u, "check value", 9);
  for (size_t n : {0ul, 1ul, 7ul, 8ul, 9ul, 100ul, 4096ul, 98303ul, 98304ul, 98305ul, 300017ul, 1000003ul}) {
    std::vector<unsigned char> v(n);
    for (size_t i = 0; i < n; ++i) { v[i] = static_cast<unsigned char>(i * 131 + 7 + (i >> 9)); }
    const uint32_t whole = fastdcp::crc32c(v.data(), n);
    check(whole == reference(v.data(), n), "matches the bitwise reference", n);
    const size_t cut = n / 3;
    check(fastdcp::crc32c(v.data() + cut, n - cut, fastdcp::crc32c(v.data(), cut)) == whole, "chains", n);
  }
  std::printf("hardware path: %s\n", fastdcp::crc32c_hardware() ? "yes" : "no");
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
