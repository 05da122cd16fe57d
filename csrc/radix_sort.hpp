// A stable sort order of unsigned 64-bit keys in linear time, for the coordinator's planning.
//
// The global save plan at thousands of ranks sorts tens of millions of int64 keys (the rows'
// (fqn, offsets) keys for dedup, the kept rows by entry); torch's comparison sort spends ~120 ns
// a key at 20 M keys on one core. A least-significant-digit radix sort touches each key once per
// 8 bits the keys use.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastdcp {

/// Writes to `order` the stable ascending order of the `n` keys at `keys`: the permutation `p`
/// with keys[p[0]] <= keys[p[1]] <= ... and, among equal keys, ascending indices (what
/// torch.argsort(keys, stable=True) gives for non-negative keys).
///
/// Each key is packed with its index into one 64-bit word (key above the index's bits) and the
/// words are radix-sorted on the key's bits, 8 at a time, skipping digits every key shares:
/// O(n * key bits / 8) time, 8n bytes of scratch besides `order` (used as the second buffer).
///
/// Returns false, writing nothing, when a key and an index do not fit 64 bits together
/// (bit_width(largest key) + bit_width(n - 1) > 64): the caller sorts another way.
/// Preconditions: `keys` holds n values and `order` room for n int64s; the ranges do not overlap.
/// Throws std::bad_alloc when the scratch cannot be allocated (nothing written then).
bool stable_argsort_u64(const uint64_t* keys, size_t n, int64_t* order);

}  // namespace fastdcp
