// Many asynchronous copies enqueued by one call: the device-to-host copies that stage a whole
// state dict (hundreds of tensors) without a round trip through Python per tensor.
//
// Only the CUDA runtime is needed; no torch. The binding passes a packed table of jobs in host
// memory and the stream (torch.cuda.Stream.cuda_stream) the copies are ordered on.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fastdcp {

/// One copy of `nbytes` bytes from `src` to `dst` (device or host addresses; the runtime tells
/// them apart through unified addressing). Three int64 words, so a table of jobs is a flat int64
/// array {dst, src, nbytes, dst, src, nbytes, ...}.
struct MemcpyJob {
  uint64_t dst;
  uint64_t src;
  int64_t nbytes;
};
static_assert(sizeof(MemcpyJob) == 24, "the binding packs three int64 words per job");

/// Enqueues `jobs[0..count)` on `stream` in order, each with cudaMemcpyAsync(cudaMemcpyDefault).
/// Jobs of 0 bytes are skipped. Copies between device memory and page-locked host memory are
/// asynchronous; with pageable host memory the runtime makes them synchronous with respect to the
/// host (correct, only slower): callers stage into page-locked memory.
/// Preconditions: every pointer is valid for its bytes until the copies have run on `stream`;
/// destinations do not overlap each other or any source.
/// Returns the first error with the index of its job in `*failed` (count when none); the jobs
/// before it are enqueued, the ones after it are not. Does not synchronise.
cudaError_t memcpy_batch_async(const MemcpyJob* jobs, size_t count, cudaStream_t stream, size_t* failed);

}  // namespace fastdcp
