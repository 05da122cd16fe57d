#include "radix_sort.hpp"

#include <array>
#include <memory>
#include <utility>
#include <vector>

namespace fastdcp {

namespace {

constexpr int kDigitBits = 8;
constexpr size_t kBuckets = size_t{1} << kDigitBits;
constexpr uint64_t kDigitMask = kBuckets - 1;

int bit_width(uint64_t value)
{
  int bits = 0;
  while (value != 0) {
    ++bits;
    value >>= 1;
  }
  return bits;
}

}  // namespace

bool stable_argsort_u64(const uint64_t* keys, size_t n, int64_t* order)
{
  if (n == 0) { return true; }
  uint64_t largest = 0;
  for (size_t i = 0; i < n; ++i) { largest = keys[i] > largest ? keys[i] : largest; }
  const int index_bits = bit_width(static_cast<uint64_t>(n - 1));
  const int key_bits = bit_width(largest);
  if (key_bits + index_bits > 64) { return false; }
  const uint64_t index_mask = index_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << index_bits) - 1;
  const int digits = (key_bits + kDigitBits - 1) / kDigitBits;

  // Pack (key, index) words and count every digit's histogram in the same read of the keys.
  std::unique_ptr<uint64_t[]> words(new uint64_t[n]);
  std::vector<std::array<size_t, kBuckets>> counts(static_cast<size_t>(digits));
  for (auto& histogram : counts) { histogram.fill(0); }
  for (size_t i = 0; i < n; ++i) {
    const uint64_t key = keys[i];
    words[i] = (index_bits == 64 ? 0 : key << index_bits) | i;
    for (int d = 0; d < digits; ++d) { ++counts[static_cast<size_t>(d)][(key >> (d * kDigitBits)) & kDigitMask]; }
  }

  // `order` is the second buffer: words go back and forth between the two.
  uint64_t* from = words.get();
  uint64_t* to = reinterpret_cast<uint64_t*>(order);
  for (int d = 0; d < digits; ++d) {
    auto& histogram = counts[static_cast<size_t>(d)];
    const int shift = index_bits + d * kDigitBits;
    // A digit every key shares changes no position: skip it.
    if (histogram[(from[0] >> shift) & kDigitMask] == n) { continue; }
    size_t start = 0;
    for (auto& count : histogram) {
      const size_t c = count;
      count = start;
      start += c;
    }
    for (size_t i = 0; i < n; ++i) {
      const uint64_t word = from[i];
      to[histogram[(word >> shift) & kDigitMask]++] = word;
    }
    std::swap(from, to);
  }
  // Unpack the indices into `order` (in place when the sorted words are already there).
  for (size_t i = 0; i < n; ++i) { order[i] = static_cast<int64_t>(from[i] & index_mask); }
  return true;
}

}  // namespace fastdcp
