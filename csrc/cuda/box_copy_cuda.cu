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

// Full unrolling of the fixed-count loops that keep several loads in flight; host compilers get
// no pragma (they unroll such loops on their own, and some warn about nvcc's).
#if defined(__CUDA_ARCH__)
#define FASTDCP_UNROLL _Pragma("unroll")
#else
#define FASTDCP_UNROLL
#endif

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
// Whole rows of a 2-D byte copy (the column halves a Shard(1) load places)
// ---------------------------------------------------------------------------------------------

/// Most units (words or bytes) one copy_row_units call walks: its flat index and its row and unit
/// counters are 32-bit, with room left for the block's stride past the end.
constexpr int64_t kMaxFlatUnits = int64_t{1} << 30;

/// Units each thread of copy_row_units loads before it stores them.
constexpr int kUnitsInFlight = 4;

/// A thread's place in a flat walk over rows of `row_units` units: flat index i is unit
/// `i % row_units` of row `i / row_units`. Construction divides once (32-bit); advance() moves
/// kThreads indices on with adds and one compare, whatever the row length.
/// Precondition: 1 <= row_units.
struct RowCursor {
  uint32_t row;
  uint32_t unit;
  uint32_t row_units;
  uint32_t step_rows;  ///< kThreads / row_units
  uint32_t step_units;  ///< kThreads % row_units

  FASTDCP_HD RowCursor(uint32_t index, uint32_t units_per_row)
    : row(index / units_per_row),
      unit(index % units_per_row),
      row_units(units_per_row),
      step_rows(static_cast<uint32_t>(kThreads) / units_per_row),
      step_units(static_cast<uint32_t>(kThreads) % units_per_row)
  {
  }

  /// Moves to flat index + kThreads. unit and step_units are both below row_units, so one
  /// subtraction brings their sum back into the row.
  FASTDCP_HD void advance()
  {
    unit += step_units;
    row += step_rows;
    if (unit >= row_units) {
      unit -= row_units;
      ++row;
    }
  }
};

/// Address of unit `unit` of row `row` of a side whose rows are `pitch` bytes apart.
template <typename Unit, typename Byte>
FASTDCP_HD Byte* unit_address(Byte* base, int64_t pitch, uint32_t row, uint32_t unit)
{
  return base + static_cast<int64_t>(row) * pitch +
         static_cast<int64_t>(unit) * static_cast<int64_t>(sizeof(Unit));
}

/// Thread `thread`'s share of copying `rows` rows of `row_units` Units each, row r from
/// src + r * src_pitch to dst + r * dst_pitch. The rows are one flat walk in steps of kThreads,
/// so short rows do not leave threads idle, and each thread loads kUnitsInFlight units (from up to
/// as many rows) before it stores them.
/// Preconditions: 1 <= row_units; rows * row_units <= kMaxFlatUnits; src, dst and both pitches
/// are multiples of sizeof(Unit); no destination byte is also a source byte.
template <typename Unit>
FASTDCP_HD void copy_row_units(const char* src, int64_t src_pitch, char* dst, int64_t dst_pitch,
                               uint32_t rows, uint32_t row_units, int thread)
{
  const uint32_t total = rows * row_units;
  RowCursor cursor(static_cast<uint32_t>(thread), row_units);
  uint32_t i = static_cast<uint32_t>(thread);
  for (; i + (kUnitsInFlight - 1) * kThreads < total; i += kUnitsInFlight * kThreads) {
    uint32_t row[kUnitsInFlight];
    uint32_t unit[kUnitsInFlight];
    Unit value[kUnitsInFlight];
    FASTDCP_UNROLL
    for (int k = 0; k < kUnitsInFlight; ++k) {
      row[k] = cursor.row;
      unit[k] = cursor.unit;
      cursor.advance();
    }
    FASTDCP_UNROLL
    for (int k = 0; k < kUnitsInFlight; ++k) {
      value[k] = *reinterpret_cast<const Unit*>(unit_address<Unit>(src, src_pitch, row[k], unit[k]));
    }
    FASTDCP_UNROLL
    for (int k = 0; k < kUnitsInFlight; ++k) {
      *reinterpret_cast<Unit*>(unit_address<Unit>(dst, dst_pitch, row[k], unit[k])) = value[k];
    }
  }
  for (; i < total; i += kThreads) {
    *reinterpret_cast<Unit*>(unit_address<Unit>(dst, dst_pitch, cursor.row, cursor.unit)) =
      *reinterpret_cast<const Unit*>(unit_address<Unit>(src, src_pitch, cursor.row, cursor.unit));
    cursor.advance();
  }
}

/// Thread `thread`'s share of copying `rows` rows of `row_bytes` bytes one after the other, each
/// with copy_contiguous and the whole block: the fallback of copy_rows_as.
FASTDCP_HD void copy_rows_one_by_one(const char* src, int64_t src_pitch, char* dst,
                                     int64_t dst_pitch, int64_t rows, int64_t row_bytes, int thread)
{
  for (int64_t r = 0; r < rows; ++r) {
    copy_contiguous(src + r * src_pitch, dst + r * dst_pitch, row_bytes, thread, kThreads);
  }
}

/// copy_rows with the rows' whole Words as one flat walk, then the bytes after each row's last
/// whole Word (fewer than sizeof(Word)) as a second flat walk of single bytes.
/// Preconditions: src, dst and both pitches are multiples of sizeof(Word); rows, row_bytes >= 1.
/// Fallback: a walk longer than kMaxFlatUnits goes row by row (copy_rows_one_by_one).
template <typename Word>
FASTDCP_HD void copy_rows_as(const char* src, int64_t src_pitch, char* dst, int64_t dst_pitch,
                             int64_t rows, int64_t row_bytes, int thread)
{
  constexpr auto kWord = static_cast<int64_t>(sizeof(Word));
  const int64_t row_words = row_bytes / kWord;
  const int64_t row_tail = row_bytes - row_words * kWord;
  if (rows * max64(row_words, row_tail) > kMaxFlatUnits) {
    copy_rows_one_by_one(src, src_pitch, dst, dst_pitch, rows, row_bytes, thread);
    return;
  }
  if (row_words > 0) {
    copy_row_units<Word>(src, src_pitch, dst, dst_pitch, static_cast<uint32_t>(rows),
                         static_cast<uint32_t>(row_words), thread);
  }
  if (row_tail > 0) {
    const int64_t done = row_words * kWord;
    copy_row_units<uint8_t>(src + done, src_pitch, dst + done, dst_pitch,
                            static_cast<uint32_t>(rows), static_cast<uint32_t>(row_tail), thread);
  }
}

/// Thread `thread`'s share of copying `rows` whole rows of `row_bytes` bytes, row r from
/// src + r * src_pitch to dst + r * dst_pitch, with the widest word (16, 8, 4, 2 or 1 bytes) that
/// both base pointers and both pitches are multiples of, so that every row starts word-aligned on
/// both sides. No division per row or word: see copy_row_units. Out of line, as copy_contiguous.
/// Preconditions: rows, row_bytes >= 1; pitches >= 0; destination rows do not overlap each other
/// or any source row. Fallback: copy_rows_as's, row by row, for walks beyond kMaxFlatUnits.
__host__ __device__ __noinline__ void copy_rows(const char* src, int64_t src_pitch, char* dst,
                                                int64_t dst_pitch, int64_t rows, int64_t row_bytes,
                                                int thread)
{
  const uintptr_t alignment = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                              static_cast<uintptr_t>(src_pitch) | static_cast<uintptr_t>(dst_pitch);
  if ((alignment & 15) == 0) {
    copy_rows_as<uint4>(src, src_pitch, dst, dst_pitch, rows, row_bytes, thread);
  } else if ((alignment & 7) == 0) {
    copy_rows_as<uint2>(src, src_pitch, dst, dst_pitch, rows, row_bytes, thread);
  } else if ((alignment & 3) == 0) {
    copy_rows_as<uint32_t>(src, src_pitch, dst, dst_pitch, rows, row_bytes, thread);
  } else if ((alignment & 1) == 0) {
    copy_rows_as<uint16_t>(src, src_pitch, dst, dst_pitch, rows, row_bytes, thread);
  } else {
    copy_rows_as<uint8_t>(src, src_pitch, dst, dst_pitch, rows, row_bytes, thread);
  }
}

/// True for a same-kind 2-D box whose rows are contiguous on both sides (unit strides in the
/// last dimension): the boxes copy_row_major_range takes.
FASTDCP_HD bool is_row_major_byte_copy(const BoxCopy& box)
{
  return box.ndim == 2 && box.src_kind == box.dst_kind && box.src_stride[1] == 1 &&
         box.dst_stride[1] == 1;
}

/// Thread `thread`'s share of copying elements [lo, hi) (row-major) of a box that
/// is_row_major_byte_copy accepts: the partial row the range starts in and the partial row it
/// ends in each with copy_contiguous and the whole block, the whole rows between with copy_rows.
/// Two 64-bit divisions per call, none per row.
/// Preconditions: is_row_major_byte_copy(box); 0 <= lo < hi <= shape[0] * shape[1].
FASTDCP_HD void copy_row_major_range(const BoxCopy& box, int64_t lo, int64_t hi, int thread)
{
  const int64_t row_length = box.shape[1];
  const int64_t elem_size = box.src_elem_size;
  const int64_t src_pitch = box.src_stride[0] * elem_size;
  const int64_t dst_pitch = box.dst_stride[0] * elem_size;
  const auto* src = static_cast<const char*>(box.src);
  auto* dst = static_cast<char*>(box.dst);

  int64_t first_whole = lo / row_length;  // rows [first_whole, end_whole) are copied whole
  const int64_t end_whole = hi / row_length;
  const int64_t head = lo - first_whole * row_length;  // elements of lo's row before lo
  if (head != 0) {
    const int64_t end = min64(hi - first_whole * row_length, row_length);
    copy_contiguous(src + first_whole * src_pitch + head * elem_size,
                    dst + first_whole * dst_pitch + head * elem_size, (end - head) * elem_size,
                    thread, kThreads);
    ++first_whole;
  }
  if (end_whole > first_whole) {
    copy_rows(src + first_whole * src_pitch, src_pitch, dst + first_whole * dst_pitch, dst_pitch,
              end_whole - first_whole, row_length * elem_size, thread);
  }
  const int64_t tail = hi - end_whole * row_length;  // elements of hi's row before hi
  if (tail != 0 && end_whole >= first_whole) {  // else the head already covered that row
    copy_contiguous(src + end_whole * src_pitch, dst + end_whole * dst_pitch, tail * elem_size,
                    thread, kThreads);
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

/// Adds to `src_offset` and `dst_offset` (in elements) where row `row` of `box` starts, rows being
/// the row-major order of the dimensions before the last. Each middle dimension takes a division;
/// the outermost one takes what is left, since `row` is below the number of rows, so boxes of up
/// to 2 dimensions (all of them after simplify_box but the rare 3-D and up) take none.
/// Precondition: 0 <= row < the product of shape[0 .. ndim - 2] (0 for ndim <= 1).
FASTDCP_HD void add_row_offsets(const BoxCopy& box, int64_t row, int64_t& src_offset,
                                int64_t& dst_offset)
{
  const int last = box.ndim - 1;
  for (int d = last - 1; d >= 1; --d) {
    const int64_t index = row % box.shape[d];
    row /= box.shape[d];
    src_offset += index * box.src_stride[d];
    dst_offset += index * box.dst_stride[d];
  }
  if (last >= 1) {
    src_offset += row * box.src_stride[0];
    dst_offset += row * box.dst_stride[0];
  }
}

/// The part of copying elements [lo, hi) of `box` (row-major over its dims) that thread `thread`
/// of a block does. A same-kind 2-D box with contiguous rows goes to copy_row_major_range (its
/// whole rows as one flat walk of words). Other boxes share each row (the innermost dimension)
/// among a group of threads sized to the row, so short rows still keep the block busy and long
/// rows use every thread.
/// `kConvert`: whether the dtype conversions are compiled in. Without them the byte-copy paths
/// keep their registers (the conversion switch, inlined, costs occupancy). Precondition for
/// `kConvert == false`: every box has src_kind == dst_kind (a converting box is left untouched).
/// Precondition: 0 <= lo < hi <= box_num_elements(box).
template <bool kConvert>
FASTDCP_HD void copy_box_range(const BoxCopy& box, int64_t lo, int64_t hi, int thread)
{
  if (is_row_major_byte_copy(box)) {
    copy_row_major_range(box, lo, hi, thread);
    return;
  }
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
    add_row_offsets(box, row, src_offset, dst_offset);
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
#undef FASTDCP_UNROLL

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
