// Batched strided box copies on the GPU: the same BoxCopy descriptors as box_copy_cpu, executed by
// one kernel launch for a whole batch (a resharding read places thousands of boxes per call, and a
// launch per box would cost more than the copies themselves).
//
// Only the CUDA runtime is needed; no torch. The binding uploads the descriptors and the element
// prefix, then calls launch_box_copy on the destination tensors' stream.
#pragma once

#include "../box_copy.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fastdcp {

/// Launches one kernel on `stream` that copies all `num_boxes` boxes with the same semantics as
/// box_copy_cpu, except that float -> integer conversion of out-of-range values and NaN follows the
/// GPU's static_cast (what torch does on CUDA), and NaN -> bf16 gives CUDA's canonical NaN.
///
/// `d_boxes` (num_boxes descriptors, 8-byte aligned) and `d_box_elem_prefix` (num_boxes + 1 element
/// counts: prefix[0] = 0, prefix[i + 1] = prefix[i] + elements of box i, see box_element_prefix)
/// live in device memory and must stay valid until the kernel has run; `total_elems` is
/// prefix[num_boxes]. Every box's src/dst must be device-accessible pointers.
/// Preconditions: every box passed validate_box on the host (simplify_box is optional but makes
/// the copy faster: contiguous boxes take the 16-byte vector path, and a same-kind box that
/// simplifies to 2-D with contiguous rows, such as a column half, is walked as whole rows of the
/// widest word its pointers and row pitches allow); destination regions are pairwise disjoint and
/// do not overlap any source region.
/// `any_conversion`: whether some box has src_kind != dst_kind. False launches the byte-copy-only
/// kernel (more resident threads for the common same-dtype load); a converting box passed with
/// false is not copied, so callers that cannot tell pass true.
/// Does not synchronise. Returns the launch error (cudaSuccess when there is nothing to copy).
cudaError_t launch_box_copy(const BoxCopy* d_boxes, const int64_t* d_box_elem_prefix,
                            size_t num_boxes, int64_t total_elems, cudaStream_t stream,
                            bool any_conversion = true);

}  // namespace fastdcp
