// Memory copies for the box copy: non-temporal (streaming) stores for large runs, and a copy that
// always walks forward for the row-sized runs of strided boxes.
//
// An async_save staging copy writes hundreds of MiB into a slab that nothing reads again soon (the
// writer sends it to storage from another thread). A plain memcpy of such a run pays a
// read-for-ownership of every destination line and evicts the cache; streaming stores write whole
// lines straight to memory instead. Measured with a standalone C program on a 2-core VM,
// 1 GiB in 1 MiB pieces on 2 threads: 53 ms with memcpy, 42 ms streaming.
//
// A strided box (the column half of a matrix, say) is copied row by row. glibc's x86-64 memcpy
// copies a run of a few KiB backwards when the destination lies less than 256 bytes after the
// source modulo 4 KiB (its guard against 4K-aliasing stalls), and page-aligned tensors put every
// other row of such a box in that case; the backward loop defeats the hardware prefetchers of some
// CPUs (docs/performance.md has the measurements). forward_copy sidesteps that loop.
#pragma once

#include <cstddef>

namespace fastdcp {

/// Runs shorter than this are copied with memcpy: their destination is likely read again while
/// still cached, and the fence after the streaming stores would dominate.
constexpr size_t kStreamCopyMinBytes = size_t{256} << 10;

/// Copies `n` bytes from `src` to `dst` (the ranges must not overlap), like memcpy.
///
/// From kStreamCopyMinBytes up on x86-64, the bulk goes through non-temporal stores (AVX2 where the
/// CPU has it, else SSE2) to 64-byte-aligned destination lines, with memcpy for the unaligned head
/// and the tail, followed by a store fence: the bytes are visible to other threads once this
/// returns. Elsewhere (other architectures, short runs) it is forward_copy.
void stream_copy(void* dst, const void* src, size_t n);

/// Runs shorter than this always go to memcpy in forward_copy: glibc copies them with a few
/// overlapping vector moves and never backwards.
constexpr size_t kForwardCopyMinBytes = 256;

/// Copies `n` bytes from `src` to `dst` (the ranges must not overlap), like memcpy, with the same
/// result, but never back to front.
///
/// On x86-64, a run of at least kForwardCopyMinBytes whose source and destination share their
/// offset within a 4 KiB page (the case glibc's memcpy copies backwards) is copied here: memcpy
/// for the head up to the first 64-byte destination line (which, at the same page offset, is a
/// source line too), 64-byte lines with four 16-byte SSE2 loads before four aligned stores, memcpy
/// for the tail. With equal page offsets a load never follows a pending store to the same offset,
/// so walking forward cannot meet the 4K-aliasing stall glibc's guard is for.
/// Fallback: every other run, and every run on other architectures, is memcpy.
void forward_copy(void* dst, const void* src, size_t n);

}  // namespace fastdcp
