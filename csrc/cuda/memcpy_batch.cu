#include "memcpy_batch.cuh"

namespace fastdcp {

cudaError_t memcpy_batch_async(const MemcpyJob* jobs, size_t count, cudaStream_t stream, size_t* failed)
{
  for (size_t i = 0; i < count; ++i) {
    const MemcpyJob& job = jobs[i];
    if (job.nbytes <= 0) { continue; }
    cudaError_t status =
      cudaMemcpyAsync(reinterpret_cast<void*>(static_cast<uintptr_t>(job.dst)),
                      reinterpret_cast<const void*>(static_cast<uintptr_t>(job.src)),
                      static_cast<size_t>(job.nbytes), cudaMemcpyDefault, stream);
    if (status != cudaSuccess) {
      if (failed != nullptr) { *failed = i; }
      return status;
    }
  }
  if (failed != nullptr) { *failed = count; }
  return cudaSuccess;
}

}  // namespace fastdcp
