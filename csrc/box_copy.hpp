// Batched strided box copies: the scatter/gather step of a resharding read.
//
// A box is a rectangular N-D region copied from a source view to a destination view, each described
// by a base pointer and per-dimension element strides. The checkpoint reader turns every
// (saved chunk, local chunk) overlap into one box whose source is the staging buffer the file bytes
// were read into and whose destination is the tensor being loaded. Boxes may convert the dtype on
// the way (for example an fp32 checkpoint loaded into a bf16 model), with torch's rounding rules.
//
// This header has no torch and no CUDA dependency: the binding fills BoxCopy descriptors from
// tensors, and the CUDA launcher (cuda/box_copy_cuda.cuh) consumes the same descriptors on the GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace fastdcp {

class ThreadPool;

/// The most dimensions a box may have (torch tensors of higher rank are rare in checkpoints;
/// after simplify_box most boxes have 1 or 2).
constexpr int kMaxBoxDims = 8;

/// Element types a box understands. The values equal c10::ScalarType so the binding can
/// static_assert the correspondence and pass `static_cast<int32_t>(tensor.scalar_type())`;
/// a dtype not listed here (uint16, float8 variants, quantized types, ...) travels as kRawBytes
/// and can then only be copied to the same dtype.
enum class ScalarKind : int32_t {
  kRawBytes = -1,  ///< opaque elements of `elem_size` bytes; copy only
  kUInt8 = 0,
  kInt8 = 1,
  kInt16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kFloat16 = 5,
  kFloat32 = 6,
  kFloat64 = 7,
  kComplex64 = 9,    ///< copy only (to complex64)
  kComplex128 = 10,  ///< copy only (to complex128)
  kBool = 11,
  kBFloat16 = 15,
};

/// One rectangular region to copy. Trivially copyable: arrays of it are uploaded to the GPU as is.
/// Strides are in elements of the respective side and must be >= 0.
struct BoxCopy {
  const void* src;
  void* dst;
  int32_t ndim;           ///< 0..kMaxBoxDims (0-d = one element)
  int32_t src_kind;       ///< ScalarKind of the source elements
  int32_t dst_kind;       ///< ScalarKind of the destination elements
  int32_t src_elem_size;  ///< bytes per source element
  int32_t dst_elem_size;  ///< bytes per destination element
  int64_t shape[kMaxBoxDims];
  int64_t src_stride[kMaxBoxDims];
  int64_t dst_stride[kMaxBoxDims];
};
static_assert(std::is_trivially_copyable_v<BoxCopy> && std::is_standard_layout_v<BoxCopy>);
static_assert(sizeof(BoxCopy) == 40 + 3 * 8 * kMaxBoxDims, "the GPU sees the same layout");

/// Bytes per element of `kind`, or 0 for kRawBytes and unknown kinds.
int32_t scalar_kind_size(int32_t kind);

/// True when a box may copy `src_kind` elements into `dst_kind` elements: equal kinds (a byte copy,
/// kRawBytes included), or any pair of the real kinds bool, u8, i8, i16, i32, i64, f16, bf16, f32, f64.
bool box_kinds_supported(int32_t src_kind, int32_t dst_kind);

/// True when the box is a plain byte copy (equal kinds), false when it converts element-wise.
inline bool box_is_byte_copy(const BoxCopy& box) { return box.src_kind == box.dst_kind; }

/// Number of elements the box covers (1 for a 0-d box, 0 if any dimension is empty).
int64_t box_num_elements(const BoxCopy& box);

/// Checks a descriptor before any byte moves: ndim in range, non-negative shape and strides, no
/// destination stride 0 on a dimension longer than 1 (it would write one element several times),
/// supported kinds, element sizes that match the kinds (equal sizes for kRawBytes), non-null
/// pointers when the box is not empty. Throws std::invalid_argument naming the problem.
void validate_box(const BoxCopy& box);

/// Normalises a box in place without changing which source element lands in which destination
/// element: drops size-1 dimensions, orders dimensions by decreasing destination stride (so the
/// innermost loop walks the destination forward), and merges neighbouring dimensions that are
/// contiguous on both sides. A fully contiguous box becomes 1-D with unit strides; a 0-d or
/// all-size-1 box becomes 1-D of length 1; an empty box becomes 1-D of length 0.
/// Precondition: 0 <= ndim <= kMaxBoxDims. Postcondition: 1 <= ndim.
void simplify_box(BoxCopy& box);

/// Writes the running element counts of `boxes` into `prefix[0..num_boxes]` (prefix[0] = 0,
/// prefix[i + 1] = prefix[i] + box_num_elements(boxes[i])) and returns the total. This is the
/// per-box prefix the CUDA launcher needs.
int64_t box_element_prefix(const BoxCopy* boxes, size_t num_boxes, int64_t* prefix);

/// Copies every box on the CPU. Each box is validated (std::invalid_argument before anything is
/// copied) and simplified on a private copy; large boxes are split into element ranges of about
/// `grain_bytes` (whole rows when rows are shorter), small boxes are grouped into tasks of about
/// `grain_bytes`, and the tasks run on `pool` (inline on the caller when there is only one).
/// Same-kind 2-D boxes with contiguous rows that are column slices of the same destination rows
/// (the same row count and destination pitch, destinations less than a pitch apart) form row
/// groups, planned in pieces of whole rows that copy row r of every slice before row r + 1: the
/// destination is then written as one forward stream.
/// Equal-kind boxes copy their contiguous innermost runs with forward_copy (memcpy, but never
/// backwards: see stream_copy.hpp); other boxes convert element-wise with
/// torch's `Tensor.copy_` rules on the CPU: to f16/bf16 round-to-nearest-even via float (f64 and
/// int64 sources are first rounded to float, as torch does); float to integer truncates toward zero
/// like static_cast for in-range values (out-of-range values and NaN give what torch gives on x86:
/// the int32/int64 "indefinite" value narrowed, u8 via int64); to bool is `value != 0` (NaN is
/// true); NaN to bf16 gives 0x7FC0, NaN to f16 keeps the sign and gives 0x7E00.
/// With `streaming`, equal-kind contiguous runs go through stream_copy (non-temporal stores, see
/// stream_copy.hpp): faster where the destination is already faulted in and not read again soon
/// (a reused staging slab), about twice as slow into fresh pages (the kernel zeroes each page into
/// the cache, then the streaming store evicts it), so callers opt in.
/// With `prefault`, each task first has the kernel fault in the whole destination pages of its
/// contiguous pieces (prefault_writable, see prefault.hpp): for a destination the caller knows to
/// be fresh (a new staging slab), where a trap per page would otherwise dominate the copy.
/// Preconditions: destination regions of all boxes are pairwise disjoint and do not overlap any
/// source region; every pointer is valid for the whole call.
void box_copy_cpu(const BoxCopy* boxes, size_t num_boxes, ThreadPool& pool,
                  size_t grain_bytes = size_t{1} << 20, bool streaming = false, bool prefault = false);

/// Round-to-nearest-even float -> bfloat16 bits (NaN -> 0x7FC0). Exposed for tests.
uint16_t float_to_bfloat16_bits(float value);
/// Round-to-nearest-even float -> IEEE half bits, subnormals included (NaN -> sign | 0x7E00).
uint16_t float_to_half_bits(float value);
/// Exact bfloat16 bits -> float.
float bfloat16_bits_to_float(uint16_t bits);
/// Exact IEEE half bits -> float.
float half_bits_to_float(uint16_t bits);

}  // namespace fastdcp
