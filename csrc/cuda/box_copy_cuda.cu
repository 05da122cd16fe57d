#include "box_copy_cuda.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

namespace fastdcp {
namespace {

// The per-thread work is written as __host__ __device__ functions of (thread, number of threads)
// with no block synchronisation inside, so a host program can run the exact same code thread by
// thread to check the indexing on machines without a GPU.
#define FASTDCP_HD __host__ __device__ __forceinline__

constexpr int kThreads = 256;

FASTDCP_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
FASTDCP_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------------------------
// Element access and conversion (torch's CUDA rules: c10::convert with cuda_fp16/cuda_bf16)
// ---------------------------------------------------------------------------------------------

// Source bytes can sit at any offset of a staging buffer, so a box whose base pointer is not
// aligned to its element size is read (or written) byte by byte: an unaligned wide access faults.
template <typename T>
FASTDCP_HD T load_as(const char* p, bool aligned)
{
  if (aligned) { return *reinterpret_cast<const T*>(p); }
  T value;
  memcpy(&value, p, sizeof(T));
  return value;
}

template <typename T>
FASTDCP_HD void store_as(char* p, T value, bool aligned)
{
  if (aligned) {
    *reinterpret_cast<T*>(p) = value;
    return;
  }
  memcpy(p, &value, sizeof(T));
}

template <typename Storage>
struct PlainElement {
  using Value = Storage;
  static constexpr int kSize = sizeof(Storage);
  static FASTDCP_HD Value load(const char* p, bool aligned) { return load_as<Storage>(p, aligned); }
  static FASTDCP_HD void store(char* p, Value v, bool aligned) { store_as<Storage>(p, v, aligned); }
};

struct BoolElement {
  using Value = bool;
  static constexpr int kSize = 1;
  static FASTDCP_HD Value load(const char* p, bool) { return *reinterpret_cast<const uint8_t*>(p) != 0; }
  static FASTDCP_HD void store(char* p, Value v, bool) { *reinterpret_cast<uint8_t*>(p) = v ? 1 : 0; }
};

// f16 and bf16 compute in float: f64 and int64 sources round to float first, as c10::Half(float)
// and c10::BFloat16(float) do in torch.
struct HalfElement {
  using Value = float;
  static constexpr int kSize = 2;
  static FASTDCP_HD Value load(const char* p, bool aligned)
  {
    return __half2float(__ushort_as_half(load_as<unsigned short>(p, aligned)));
  }
  static FASTDCP_HD void store(char* p, Value v, bool aligned)
  {
    store_as<unsigned short>(p, __half_as_ushort(__float2half_rn(v)), aligned);
  }
};

struct BFloat16Element {
  using Value = float;
  static constexpr int kSize = 2;
  static FASTDCP_HD Value load(const char* p, bool aligned)
  {
    return __bfloat162float(__ushort_as_bfloat16(load_as<unsigned short>(p, aligned)));
  }
  static FASTDCP_HD void store(char* p, Value v, bool aligned)
  {
    store_as<unsigned short>(p, __bfloat16_as_ushort(__float2bfloat16(v)), aligned);
  }
};

template <typename To, typename From>
FASTDCP_HD To convert_value(From v)
{
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From{0};
  } else if constexpr (std::is_same_v<From, bool>) {
    return static_cast<To>(v ? 1 : 0);
  } else if constexpr (std::is_same_v<To, uint8_t> && std::is_floating_point_v<From>) {
    // c10 goes through int64 so that negative values wrap instead of being undefined.
    return static_cast<uint8_t>(static_cast<int64_t>(v));
  } else {
    return static_cast<To>(v);
  }
}

template <typename From, typename To>
FASTDCP_HD void convert_elements(const char* src, int64_t src_stride, bool src_aligned, char* dst,
                                 int64_t dst_stride, bool dst_aligned, int64_t n, int rank,
                                 int group)
{
  const int64_t src_step = src_stride * From::kSize;
  const int64_t dst_step = dst_stride * To::kSize;
  for (int64_t i = rank; i < n; i += group) {
    To::store(dst + i * dst_step,
              convert_value<typename To::Value>(From::load(src + i * src_step, src_aligned)),
              dst_aligned);
  }
}

template <typename From>
FASTDCP_HD void convert_elements_to(int32_t to, const char* src, int64_t src_stride,
                                    bool src_aligned, char* dst, int64_t dst_stride,
                                    bool dst_aligned, int64_t n, int rank, int group)
{
#define FASTDCP_CONVERT_TO(KIND, ELEMENT)                                                       \
  case static_cast<int32_t>(ScalarKind::KIND):                                                  \
    convert_elements<From, ELEMENT>(src, src_stride, src_aligned, dst, dst_stride, dst_aligned, \
                                    n, rank, group);                                            \
    return;
  switch (to) {
    FASTDCP_CONVERT_TO(kBool, BoolElement)
    FASTDCP_CONVERT_TO(kUInt8, PlainElement<uint8_t>)
    FASTDCP_CONVERT_TO(kInt8, PlainElement<int8_t>)
    FASTDCP_CONVERT_TO(kInt16, PlainElement<int16_t>)
    FASTDCP_CONVERT_TO(kInt32, PlainElement<int32_t>)
    FASTDCP_CONVERT_TO(kInt64, PlainElement<int64_t>)
    FASTDCP_CONVERT_TO(kFloat16, HalfElement)
    FASTDCP_CONVERT_TO(kBFloat16, BFloat16Element)
    FASTDCP_CONVERT_TO(kFloat32, PlainElement<float>)
    FASTDCP_CONVERT_TO(kFloat64, PlainElement<double>)
    default: return;  // rejected by validate_box on the host
  }
#undef FASTDCP_CONVERT_TO
}

/// Converts `n` elements of one row; `from`/`to` are ScalarKind values (block-uniform switch).
/// Inlined, not out of line: built out of line (`__noinline__`) by nvcc 13.0 for sm_90, this
/// function wrote wrong low bytes on an H100 (float32 -> bfloat16 0x3dcd came out 0x3d01) while
/// the same code inlined was exact; the GPU tests of dtype-converting loads caught it.
FASTDCP_HD void convert_row(int32_t from, int32_t to, const char* src,
                                                  int64_t src_stride, bool src_aligned, char* dst,
                                                  int64_t dst_stride, bool dst_aligned, int64_t n,
                                                  int rank, int group)
{
#define FASTDCP_CONVERT_FROM(KIND, ELEMENT)                                                  \
  case static_cast<int32_t>(ScalarKind::KIND):                                             \
    convert_elements_to<ELEMENT>(to, src, src_stride, src_aligned, dst, dst_stride,        \
                                 dst_aligned, n, rank, group);                             \
    return;
  switch (from) {
    FASTDCP_CONVERT_FROM(kBool, BoolElement)
    FASTDCP_CONVERT_FROM(kUInt8, PlainElement<uint8_t>)
    FASTDCP_CONVERT_FROM(kInt8, PlainElement<int8_t>)
    FASTDCP_CONVERT_FROM(kInt16, PlainElement<int16_t>)
    FASTDCP_CONVERT_FROM(kInt32, PlainElement<int32_t>)
    FASTDCP_CONVERT_FROM(kInt64, PlainElement<int64_t>)
    FASTDCP_CONVERT_FROM(kFloat16, HalfElement)
    FASTDCP_CONVERT_FROM(kBFloat16, BFloat16Element)
    FASTDCP_CONVERT_FROM(kFloat32, PlainElement<float>)
    FASTDCP_CONVERT_FROM(kFloat64, PlainElement<double>)
    default: return;
  }
#undef FASTDCP_CONVERT_FROM
}

// ---------------------------------------------------------------------------------------------
// Byte copies
// ---------------------------------------------------------------------------------------------

/// A group of `group` threads copies `nbytes` contiguous bytes with `Word`-sized accesses: bytes up
/// to the first Word-aligned destination address, whole words, then the tail. Precondition: src and
/// dst have the same misalignment modulo sizeof(Word).
template <typename Word>
FASTDCP_HD void copy_contiguous_words(const char* src, char* dst, int64_t nbytes, int rank,
                                      int group)
{
  constexpr int64_t kWord = sizeof(Word);
  const int64_t head =
    min64(nbytes, (kWord - static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) & (kWord - 1))) &
                    (kWord - 1));
  for (int64_t i = rank; i < head; i += group) {
    dst[i] = src[i];
  }
  const int64_t words = (nbytes - head) / kWord;
  const Word* src_words = reinterpret_cast<const Word*>(src + head);
  Word* dst_words = reinterpret_cast<Word*>(dst + head);
  // Four loads before four stores: without this the compiler must assume a store may alias the
  // next load and would keep only one access in flight per thread.
  int64_t i = rank;
  for (; i + 3 * group < words; i += 4 * group) {
    const Word w0 = src_words[i];
    const Word w1 = src_words[i + group];
    const Word w2 = src_words[i + 2 * group];
    const Word w3 = src_words[i + 3 * group];
    dst_words[i] = w0;
    dst_words[i + group] = w1;
    dst_words[i + 2 * group] = w2;
    dst_words[i + 3 * group] = w3;
  }
  for (; i < words; i += group) {
    dst_words[i] = src_words[i];
  }
  for (int64_t b = head + words * kWord + rank; b < nbytes; b += group) {
    dst[b] = src[b];
  }
}

/// Contiguous byte copy: the widest access (16 bytes in the common case) that the relative
/// alignment of src and dst allows. Out of line, so its loops get registers of their own.
__host__ __device__ __noinline__ void copy_contiguous(const char* src, char* dst, int64_t nbytes,
                                                      int rank, int group)
{
  const uintptr_t misalignment = reinterpret_cast<uintptr_t>(src) ^ reinterpret_cast<uintptr_t>(dst);
  if ((misalignment & 15) == 0) {
    copy_contiguous_words<uint4>(src, dst, nbytes, rank, group);
  } else if ((misalignment & 7) == 0) {
    copy_contiguous_words<uint2>(src, dst, nbytes, rank, group);
  } else if ((misalignment & 3) == 0) {
    copy_contiguous_words<uint32_t>(src, dst, nbytes, rank, group);
  } else if ((misalignment & 1) == 0) {
    copy_contiguous_words<uint16_t>(src, dst, nbytes, rank, group);
  } else {
    copy_contiguous_words<uint8_t>(src, dst, nbytes, rank, group);
  }
}

/// Strided copy of `n` elements of `elem_size` bytes, each moved as elem_size / sizeof(Word) words.
/// Precondition: both base pointers and elem_size are multiples of sizeof(Word).
template <typename Word>
FASTDCP_HD void copy_strided_words(const char* src, int64_t src_step, char* dst, int64_t dst_step,
                                   int64_t n, int32_t elem_size, int rank, int group)
{
  const int words_per_element = elem_size / static_cast<int>(sizeof(Word));
  for (int64_t i = rank; i < n; i += group) {
    const Word* s = reinterpret_cast<const Word*>(src + i * src_step);
    Word* d = reinterpret_cast<Word*>(dst + i * dst_step);
    for (int w = 0; w < words_per_element; ++w) {
      d[w] = s[w];
    }
  }
}

/// Same-kind copy of a row whose elements are not adjacent on at least one side (out of line, as
/// convert_row).
__host__ __device__ __noinline__ void copy_strided(const char* src, int64_t src_stride, char* dst,
                                                   int64_t dst_stride, int64_t n, int32_t elem_size,
                                                   int rank, int group)
{
  const int64_t src_step = src_stride * elem_size;
  const int64_t dst_step = dst_stride * elem_size;
  const uintptr_t alignment = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                              static_cast<uintptr_t>(elem_size);
  if ((alignment & 15) == 0) {
    copy_strided_words<uint4>(src, src_step, dst, dst_step, n, elem_size, rank, group);
  } else if ((alignment & 7) == 0) {
    copy_strided_words<uint2>(src, src_step, dst, dst_step, n, elem_size, rank, group);
  } else if ((alignment & 3) == 0) {
    copy_strided_words<uint32_t>(src, src_step, dst, dst_step, n, elem_size, rank, group);
  } else if ((alignment & 1) == 0) {
    copy_strided_words<uint16_t>(src, src_step, dst, dst_step, n, elem_size, rank, group);
  } else {
    copy_strided_words<uint8_t>(src, src_step, dst, dst_step, n, elem_size, rank, group);
  }
}

// ---------------------------------------------------------------------------------------------
// Work decomposition
// ---------------------------------------------------------------------------------------------

/// Index of the box holding global element `element` (0 <= element < prefix[num_boxes]): the last
/// box whose prefix is <= element, which skips empty boxes.
FASTDCP_HD int64_t find_box(const int64_t* prefix, int64_t num_boxes, int64_t element)
{
  int64_t low = 0;
  int64_t high = num_boxes;  // answer in [low, high)
  while (high - low > 1) {
    const int64_t mid = low + (high - low) / 2;
    if (prefix[mid] <= element) {
      low = mid;
    } else {
      high = mid;
    }
  }
  return low;
}

/// Smallest power of two >= `units`, capped at the block size: how many threads share one row.
FASTDCP_HD int threads_per_row(int64_t units)
{
  int group = 1;
  while (group < kThreads && group < units) {
    group <<= 1;
  }
  return group;
}

/// The part of copying elements [lo, hi) of `box` (row-major over its dims) that thread `thread`
/// of a block does. Rows (the innermost dimension) are shared among groups of threads sized to the
/// row, so short rows still keep the block busy and long rows use every thread.
/// `kConvert`: whether the dtype conversions are compiled in. Without them the byte-copy paths
/// keep their registers (the conversion switch, inlined, costs occupancy). Precondition for
/// `kConvert == false`: every box has src_kind == dst_kind (a converting box is left untouched).
template <bool kConvert>
FASTDCP_HD void copy_box_range(const BoxCopy& box, int64_t lo, int64_t hi, int thread)
{
  const int last = box.ndim - 1;
  const int64_t row_length = box.ndim > 0 ? box.shape[last] : 1;
  const int64_t src_inner = box.ndim > 0 ? box.src_stride[last] : 1;
  const int64_t dst_inner = box.ndim > 0 ? box.dst_stride[last] : 1;
  const bool byte_copy = box.src_kind == box.dst_kind;
  const bool contiguous_rows = byte_copy && src_inner == 1 && dst_inner == 1;

  const int64_t first_row = lo / row_length;
  const int64_t last_row = (hi - 1) / row_length;
  const int64_t elements_per_row = first_row == last_row ? hi - lo : row_length;
  const int64_t units_per_row =
    contiguous_rows ? (elements_per_row * box.src_elem_size + 15) / 16 : elements_per_row;
  const int group = threads_per_row(units_per_row);
  const int rank = thread % group;
  const int rows_per_pass = kThreads / group;

  const auto* src_base = static_cast<const char*>(box.src);
  auto* dst_base = static_cast<char*>(box.dst);
  const bool src_aligned = reinterpret_cast<uintptr_t>(src_base) % box.src_elem_size == 0;
  const bool dst_aligned = reinterpret_cast<uintptr_t>(dst_base) % box.dst_elem_size == 0;

  for (int64_t row = first_row + thread / group; row <= last_row; row += rows_per_pass) {
    const int64_t begin = row == first_row ? lo - row * row_length : 0;
    const int64_t end = row == last_row ? hi - row * row_length : row_length;
    int64_t src_offset = begin * src_inner;  // in elements
    int64_t dst_offset = begin * dst_inner;
    int64_t outer = row;
    for (int d = last - 1; d >= 0; --d) {
      const int64_t index = outer % box.shape[d];
      outer /= box.shape[d];
      src_offset += index * box.src_stride[d];
      dst_offset += index * box.dst_stride[d];
    }
    const char* src = src_base + src_offset * box.src_elem_size;
    char* dst = dst_base + dst_offset * box.dst_elem_size;
    const int64_t n = end - begin;
    if (contiguous_rows) {
      copy_contiguous(src, dst, n * box.src_elem_size, rank, group);
    } else if (byte_copy) {
      copy_strided(src, src_inner, dst, dst_inner, n, box.src_elem_size, rank, group);
    } else if constexpr (kConvert) {
      convert_row(box.src_kind, box.dst_kind, src, src_inner, src_aligned, dst, dst_inner,
                  dst_aligned, n, rank, group);
    }
  }
}

/// Each block walks chunks of `chunk_elements` global elements (grid-stride); for every box
/// overlapping its chunk it stages the descriptor in shared memory and copies the overlap.
template <bool kConvert>
__global__ void __launch_bounds__(kThreads)
  box_copy_kernel(const BoxCopy* __restrict__ boxes, const int64_t* __restrict__ prefix,
                  int64_t num_boxes, int64_t total_elements, int64_t chunk_elements)
{
  __shared__ BoxCopy box;
  __shared__ int64_t chunk_first_box;
  constexpr int kBoxWords = sizeof(BoxCopy) / sizeof(uint64_t);
  static_assert(sizeof(BoxCopy) % sizeof(uint64_t) == 0 && kBoxWords <= kThreads);

  for (int64_t chunk_begin = static_cast<int64_t>(blockIdx.x) * chunk_elements;
       chunk_begin < total_elements;
       chunk_begin += static_cast<int64_t>(gridDim.x) * chunk_elements) {
    const int64_t chunk_end = min64(total_elements, chunk_begin + chunk_elements);
    if (threadIdx.x == 0) { chunk_first_box = find_box(prefix, num_boxes, chunk_begin); }
    __syncthreads();
    const int64_t first_box = chunk_first_box;
    for (int64_t b = first_box; b < num_boxes; ++b) {
      const int64_t box_begin = prefix[b];
      if (box_begin >= chunk_end) { break; }
      const int64_t box_end = prefix[b + 1];
      if (box_end == box_begin) { continue; }
      if (threadIdx.x < kBoxWords) {
        reinterpret_cast<uint64_t*>(&box)[threadIdx.x] =
          reinterpret_cast<const uint64_t*>(boxes + b)[threadIdx.x];
      }
      __syncthreads();
      copy_box_range<kConvert>(box, max64(chunk_begin, box_begin) - box_begin,
                     min64(chunk_end, box_end) - box_begin, static_cast<int>(threadIdx.x));
      __syncthreads();  // everyone is done with `box` before the next descriptor overwrites it
    }
    __syncthreads();  // everyone has read chunk_first_box before thread 0 rewrites it
  }
}

/// Elements per block-chunk: about one chunk per resident block, at least 1024 elements (so each
/// chunk amortises its box search) and at most 64 Ki elements (so large copies still balance).
int64_t chunk_elements_for(int64_t total_elements, int64_t resident_blocks)
{
  constexpr int64_t kMinChunk = 1024;
  constexpr int64_t kMaxChunk = 64 * 1024;
  int64_t chunk = (total_elements + resident_blocks - 1) / resident_blocks;
  chunk = (chunk + kMinChunk - 1) / kMinChunk * kMinChunk;
  return min64(kMaxChunk, max64(kMinChunk, chunk));
}

#undef FASTDCP_HD

}  // namespace

cudaError_t launch_box_copy(const BoxCopy* d_boxes, const int64_t* d_box_elem_prefix,
                            size_t num_boxes, int64_t total_elems, cudaStream_t stream,
                            bool any_conversion)
{
  if (num_boxes == 0 || total_elems <= 0) { return cudaSuccess; }
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) { return status; }
  int multiprocessors = 0;
  int threads_per_multiprocessor = 0;
  status = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) { return status; }
  status = cudaDeviceGetAttribute(&threads_per_multiprocessor,
                                  cudaDevAttrMaxThreadsPerMultiProcessor, device);
  if (status != cudaSuccess) { return status; }

  const int64_t resident_blocks =
    max64(1, static_cast<int64_t>(multiprocessors) * max64(1, threads_per_multiprocessor / kThreads));
  const int64_t chunk = chunk_elements_for(total_elems, resident_blocks);
  const int64_t num_chunks = (total_elems + chunk - 1) / chunk;
  // Beyond a few waves, more blocks only add scheduling; the grid-stride loop covers the rest.
  const auto grid = static_cast<unsigned int>(min64(num_chunks, resident_blocks * 4));
  if (any_conversion) {
    box_copy_kernel<true><<<grid, kThreads, 0, stream>>>(
      d_boxes, d_box_elem_prefix, static_cast<int64_t>(num_boxes), total_elems, chunk);
  } else {
    box_copy_kernel<false><<<grid, kThreads, 0, stream>>>(
      d_boxes, d_box_elem_prefix, static_cast<int64_t>(num_boxes), total_elems, chunk);
  }
  return cudaGetLastError();
}

}  // namespace fastdcp
