#include "crc32c.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace fastdcp {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // CRC-32C, reflected

// table[k][b]: the CRC of byte b followed by k zero bytes (slicing-by-8).
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables()
  {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) { c = (c >> 1) ^ (kPolynomial & (0u - (c & 1u))); }
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) { t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF]; }
    }
  }
};

const Tables& tables()
{
  static const Tables instance;
  return instance;
}

uint32_t crc32c_software(const unsigned char* p, size_t n, uint32_t crc)
{
  const auto& t = tables().t;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= crc;
    crc = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^
          t[4][(word >> 24) & 0xFF] ^ t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^
          t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) { crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF]; }
  return crc;
}

#if defined(__x86_64__)
constexpr size_t kBlock = 1 << 15;  // bytes per interleaved stream per round

// Advancing a raw CRC register over kBlock zero bytes is linear over GF(2): tabulate it per byte
// of the register (4 x 256 entries), built from the 32 basis vectors once.
struct ZeroShift {
  std::array<std::array<uint32_t, 256>, 4> t{};
  ZeroShift()
  {
    static const unsigned char zeros[kBlock] = {};
    std::array<uint32_t, 32> basis{};
    for (int bit = 0; bit < 32; ++bit) { basis[bit] = crc32c_software(zeros, kBlock, 1u << bit); }
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t v = 0;
        for (int i = 0; i < 8; ++i) {
          if (b & (1u << i)) { v ^= basis[8 * k + i]; }
        }
        t[k][b] = v;
      }
    }
  }
  [[nodiscard]] uint32_t apply(uint32_t crc) const
  {
    return t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24];
  }
};

const ZeroShift& zero_shift()
{
  static const ZeroShift instance;
  return instance;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* p, size_t n, uint32_t crc)
{
  // Three independent streams hide the instruction's 3-cycle latency; they are joined with the
  // tabulated zero shift.
  const ZeroShift& shift = zero_shift();
  uint64_t c0 = crc;
  while (n >= 3 * kBlock) {
    uint64_t c1 = 0, c2 = 0;
    const unsigned char* p1 = p + kBlock;
    const unsigned char* p2 = p + 2 * kBlock;
    for (size_t i = 0; i < kBlock; i += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p1 + i, 8);
      std::memcpy(&w2, p2 + i, 8);
      c0 = _mm_crc32_u64(c0, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    // crc(A|B|C) = shift(shift(cA, |B|) ^ cB, |C|) ^ cC, with raw (non-inverted) register values.
    uint32_t joined = shift.apply(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    joined = shift.apply(joined) ^ static_cast<uint32_t>(c2);
    c0 = joined;
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c0 = _mm_crc32_u64(c0, w);
    p += 8;
    n -= 8;
  }
  auto c = static_cast<uint32_t>(c0);
  while (n-- > 0) { c = _mm_crc32_u8(c, *p++); }
  return c;
}
#endif

}  // namespace

bool crc32c_hardware()
{
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc)
{
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t state = ~crc;
#if defined(__x86_64__)
  if (crc32c_hardware()) { return ~crc32c_sse42(p, nbytes, state); }
#endif
  return ~crc32c_software(p, nbytes, state);
}

}  // namespace fastdcp
