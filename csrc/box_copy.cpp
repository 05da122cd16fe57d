#include "box_copy.hpp"

#include "prefault.hpp"
#include "stream_copy.hpp"
#include "thread_pool.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace fastdcp {

// ---------------------------------------------------------------------------------------------
// Scalar conversions (bit-exact with torch's CPU Tensor.copy_ for finite values)
// ---------------------------------------------------------------------------------------------

namespace {

uint32_t float_bits(float value)
{
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float float_from_bits(uint32_t bits)
{
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

}  // namespace

uint16_t float_to_bfloat16_bits(float value)
{
  const uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) { return 0x7fc0; }
  // Adding 0x7fff plus the lowest kept bit rounds half-way cases to the even neighbour; a carry out
  // of the mantissa correctly bumps the exponent (and overflows to infinity).
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

float bfloat16_bits_to_float(uint16_t bits) { return float_from_bits(static_cast<uint32_t>(bits) << 16); }

uint16_t float_to_half_bits(float value)
{
  const uint32_t bits = float_bits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) { return sign | 0x7e00; }  // NaN: quiet, payload dropped
  if (magnitude >= 0x477ff000u) { return sign | 0x7c00; }  // >= 65520 rounds to infinity
  if (magnitude >= 0x38800000u) {
    // Normal half: re-bias the exponent by (127 - 15) and round the 13 dropped mantissa bits to
    // nearest even; a carry into the exponent is the correct result.
    const uint32_t lsb = (magnitude >> 13) & 1u;
    const uint32_t rebased = magnitude - (112u << 23);
    return sign | static_cast<uint16_t>((rebased + 0xfffu + lsb) >> 13);
  }
  // Subnormal half (or zero): the result counts units of 2^-24.
  const uint32_t exponent = magnitude >> 23;
  if (exponent < 102) { return sign; }  // below 2^-25: rounds to zero
  const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exponent;  // 14..24
  uint32_t units = mantissa >> shift;
  const uint32_t remainder = mantissa & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (remainder > halfway || (remainder == halfway && (units & 1u))) { ++units; }
  return sign | static_cast<uint16_t>(units);  // units == 0x400 is the smallest normal: correct
}

float half_bits_to_float(uint16_t bits)
{
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) { return float_from_bits(sign | 0x7f800000u | (mantissa << 13)); }
  if (exponent != 0) { return float_from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13)); }
  if (mantissa == 0) { return float_from_bits(sign); }
  // Subnormal half: normalise into a float exponent.
  uint32_t float_exponent = 113;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --float_exponent;
  }
  return float_from_bits(sign | (float_exponent << 23) | ((mantissa & 0x3ffu) << 13));
}

namespace {

// Each element type is described by how it is loaded into and stored from a "value" type in which
// conversions happen. f16/bf16 compute in float, so f64 -> bf16 rounds to float first, exactly like
// c10::BFloat16(float). Loads and stores go through memcpy: staging buffers hold tensor bytes at
// whatever file offset the checkpoint put them, so source elements can be misaligned.
template <typename Storage, typename ValueT>
struct PlainElement {
  using Value = ValueT;
  static constexpr int kSize = sizeof(Storage);
  static Value load(const std::byte* p)
  {
    Storage s;
    std::memcpy(&s, p, sizeof(s));
    return static_cast<Value>(s);
  }
  static void store(std::byte* p, Value v)
  {
    Storage s = static_cast<Storage>(v);
    std::memcpy(p, &s, sizeof(s));
  }
};

struct BoolElement {
  using Value = bool;
  static constexpr int kSize = 1;
  // Any non-zero byte reads as true (torch's bool storage is 0/1, but a byte is never UB here).
  static Value load(const std::byte* p) { return std::to_integer<uint8_t>(*p) != 0; }
  static void store(std::byte* p, Value v) { *p = std::byte{static_cast<uint8_t>(v ? 1 : 0)}; }
};

struct HalfElement {
  using Value = float;
  static constexpr int kSize = 2;
  static Value load(const std::byte* p)
  {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return half_bits_to_float(bits);
  }
  static void store(std::byte* p, Value v)
  {
    const uint16_t bits = float_to_half_bits(v);
    std::memcpy(p, &bits, 2);
  }
};

struct BFloat16Element {
  using Value = float;
  static constexpr int kSize = 2;
  static Value load(const std::byte* p)
  {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return bfloat16_bits_to_float(bits);
  }
  static void store(std::byte* p, Value v)
  {
    const uint16_t bits = float_to_bfloat16_bits(v);
    std::memcpy(p, &bits, 2);
  }
};

using UInt8Element = PlainElement<uint8_t, uint8_t>;
using Int8Element = PlainElement<int8_t, int8_t>;
using Int16Element = PlainElement<int16_t, int16_t>;
using Int32Element = PlainElement<int32_t, int32_t>;
using Int64Element = PlainElement<int64_t, int64_t>;
using Float32Element = PlainElement<float, float>;
using Float64Element = PlainElement<double, double>;

// Float -> int32 the way x86 cvttsd2si does it: truncation in range, INT32_MIN otherwise (NaN too).
// Written out so that it is not undefined behaviour in C++.
int32_t truncate_to_int32(double v)
{
  if (v > -2147483649.0 && v < 2147483648.0) { return static_cast<int32_t>(v); }
  return std::numeric_limits<int32_t>::min();
}

int64_t truncate_to_int64(double v)
{
  if (v >= -9223372036854775808.0 && v < 9223372036854775808.0) { return static_cast<int64_t>(v); }
  return std::numeric_limits<int64_t>::min();
}

/// The conversion between value types: torch's c10::convert semantics for in-range values.
template <typename To, typename From>
To convert_value(From v)
{
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From{0};  // NaN != 0 is true, as in torch
  } else if constexpr (std::is_same_v<From, bool>) {
    return static_cast<To>(v ? 1 : 0);
  } else if constexpr (std::is_integral_v<To> && std::is_floating_point_v<From>) {
    // torch narrows i8/i16 through a 32-bit truncation and u8 through int64 (c10's
    // static_cast_with_inter_type); these match it bit for bit on x86, out-of-range values included.
    if constexpr (std::is_same_v<To, int64_t>) {
      return truncate_to_int64(static_cast<double>(v));
    } else if constexpr (std::is_same_v<To, uint8_t>) {
      return static_cast<uint8_t>(truncate_to_int64(static_cast<double>(v)));
    } else {
      return static_cast<To>(truncate_to_int32(static_cast<double>(v)));
    }
  } else {
    return static_cast<To>(v);  // int <-> int wraps; int -> float and f64 -> f32 round to nearest
  }
}

// ---------------------------------------------------------------------------------------------
// Run copiers: one innermost row of a box
// ---------------------------------------------------------------------------------------------

/// Copies `n` elements from `src` (stride `src_stride` elements) to `dst` (stride `dst_stride`).
using RunCopier = void (*)(const std::byte* src, int64_t src_stride, std::byte* dst,
                           int64_t dst_stride, int64_t n, int32_t elem_size);

template <int kSize>
void strided_copy_fixed(const std::byte* src, int64_t src_stride, std::byte* dst, int64_t dst_stride,
                        int64_t n)
{
  const int64_t src_step = src_stride * kSize;
  const int64_t dst_step = dst_stride * kSize;
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * dst_step, src + i * src_step, kSize);
  }
}

/// Copies `n` elements of `elem_size` bytes, each side with its own element stride. A run that is
/// contiguous on both sides is one stream_copy (`kStreaming`) or forward_copy: a strided box calls
/// this once per row, and forward_copy keeps rows that share their page offset with their source
/// off glibc's backward loop (see stream_copy.hpp). Other runs move element by element.
template <bool kStreaming>
void byte_copy_run(const std::byte* src, int64_t src_stride, std::byte* dst, int64_t dst_stride,
                   int64_t n, int32_t elem_size)
{
  if (src_stride == 1 && dst_stride == 1) {
    const auto nbytes = static_cast<size_t>(n) * static_cast<size_t>(elem_size);
    if constexpr (kStreaming) {
      stream_copy(dst, src, nbytes);
    } else {
      forward_copy(dst, src, nbytes);
    }
    return;
  }
  switch (elem_size) {
    case 1: strided_copy_fixed<1>(src, src_stride, dst, dst_stride, n); return;
    case 2: strided_copy_fixed<2>(src, src_stride, dst, dst_stride, n); return;
    case 4: strided_copy_fixed<4>(src, src_stride, dst, dst_stride, n); return;
    case 8: strided_copy_fixed<8>(src, src_stride, dst, dst_stride, n); return;
    case 16: strided_copy_fixed<16>(src, src_stride, dst, dst_stride, n); return;
    default: break;
  }
  const int64_t src_step = src_stride * elem_size;
  const int64_t dst_step = dst_stride * elem_size;
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * dst_step, src + i * src_step, static_cast<size_t>(elem_size));
  }
}

template <typename From, typename To>
void convert_run(const std::byte* src, int64_t src_stride, std::byte* dst, int64_t dst_stride,
                 int64_t n, int32_t /*elem_size*/)
{
  if (src_stride == 1 && dst_stride == 1) {
    // Separate unit-stride loop so the compiler can vectorise the common contiguous case.
    for (int64_t i = 0; i < n; ++i) {
      To::store(dst + i * To::kSize,
                convert_value<typename To::Value>(From::load(src + i * From::kSize)));
    }
    return;
  }
  const int64_t src_step = src_stride * From::kSize;
  const int64_t dst_step = dst_stride * To::kSize;
  for (int64_t i = 0; i < n; ++i) {
    To::store(dst + i * dst_step, convert_value<typename To::Value>(From::load(src + i * src_step)));
  }
}

template <typename From>
RunCopier converter_to(ScalarKind to)
{
  switch (to) {
    case ScalarKind::kBool: return &convert_run<From, BoolElement>;
    case ScalarKind::kUInt8: return &convert_run<From, UInt8Element>;
    case ScalarKind::kInt8: return &convert_run<From, Int8Element>;
    case ScalarKind::kInt16: return &convert_run<From, Int16Element>;
    case ScalarKind::kInt32: return &convert_run<From, Int32Element>;
    case ScalarKind::kInt64: return &convert_run<From, Int64Element>;
    case ScalarKind::kFloat16: return &convert_run<From, HalfElement>;
    case ScalarKind::kBFloat16: return &convert_run<From, BFloat16Element>;
    case ScalarKind::kFloat32: return &convert_run<From, Float32Element>;
    case ScalarKind::kFloat64: return &convert_run<From, Float64Element>;
    default: return nullptr;
  }
}

RunCopier converter(ScalarKind from, ScalarKind to)
{
  switch (from) {
    case ScalarKind::kBool: return converter_to<BoolElement>(to);
    case ScalarKind::kUInt8: return converter_to<UInt8Element>(to);
    case ScalarKind::kInt8: return converter_to<Int8Element>(to);
    case ScalarKind::kInt16: return converter_to<Int16Element>(to);
    case ScalarKind::kInt32: return converter_to<Int32Element>(to);
    case ScalarKind::kInt64: return converter_to<Int64Element>(to);
    case ScalarKind::kFloat16: return converter_to<HalfElement>(to);
    case ScalarKind::kBFloat16: return converter_to<BFloat16Element>(to);
    case ScalarKind::kFloat32: return converter_to<Float32Element>(to);
    case ScalarKind::kFloat64: return converter_to<Float64Element>(to);
    default: return nullptr;
  }
}

RunCopier run_copier_for(const BoxCopy& box, bool streaming)
{
  if (box_is_byte_copy(box)) { return streaming ? &byte_copy_run<true> : &byte_copy_run<false>; }
  return converter(static_cast<ScalarKind>(box.src_kind), static_cast<ScalarKind>(box.dst_kind));
}

bool is_convertible_kind(int32_t kind)
{
  switch (static_cast<ScalarKind>(kind)) {
    case ScalarKind::kBool:
    case ScalarKind::kUInt8:
    case ScalarKind::kInt8:
    case ScalarKind::kInt16:
    case ScalarKind::kInt32:
    case ScalarKind::kInt64:
    case ScalarKind::kFloat16:
    case ScalarKind::kBFloat16:
    case ScalarKind::kFloat32:
    case ScalarKind::kFloat64: return true;
    default: return false;
  }
}

// ---------------------------------------------------------------------------------------------
// Box walking
// ---------------------------------------------------------------------------------------------

/// Side of the square tiles a transposing copy walks: 32 rows keep the 32 source cache lines a
/// tile column touches resident until every element of them has been used.
constexpr int64_t kTransposeTile = 32;

/// True for a 2-D box that walks the source faster along the outer dim than along the inner one
/// (for example a stored `x.T` loaded into a contiguous tensor): its row-by-row walk would touch a
/// new source cache line for every element.
bool is_transposing(const BoxCopy& box)
{
  return box.ndim == 2 && box.src_stride[0] < box.src_stride[1];
}

/// Copies whole rows [first_row, end_row) of a transposing 2-D box tile by tile.
void copy_rows_tiled(const BoxCopy& box, RunCopier copy_run, int64_t first_row, int64_t end_row)
{
  const auto* src = static_cast<const std::byte*>(box.src);
  auto* dst = static_cast<std::byte*>(box.dst);
  const int64_t row_length = box.shape[1];
  for (int64_t tile_row = first_row; tile_row < end_row; tile_row += kTransposeTile) {
    const int64_t tile_end_row = std::min(end_row, tile_row + kTransposeTile);
    for (int64_t column = 0; column < row_length; column += kTransposeTile) {
      const int64_t n = std::min(kTransposeTile, row_length - column);
      for (int64_t row = tile_row; row < tile_end_row; ++row) {
        copy_run(src + (row * box.src_stride[0] + column * box.src_stride[1]) * box.src_elem_size,
                 box.src_stride[1],
                 dst + (row * box.dst_stride[0] + column * box.dst_stride[1]) * box.dst_elem_size,
                 box.dst_stride[1], n, box.src_elem_size);
      }
    }
  }
}

/// Copies elements [begin, end) of a simplified box (row-major element order of its dims).
void copy_box_range(const BoxCopy& box, RunCopier copy_run, int64_t begin, int64_t end)
{
  const int last = box.ndim - 1;
  const int64_t row_length = box.shape[last];
  if (is_transposing(box) && begin % row_length == 0 && end % row_length == 0) {
    copy_rows_tiled(box, copy_run, begin / row_length, end / row_length);
    return;
  }
  int64_t row = begin / row_length;
  int64_t column = begin % row_length;

  // Odometer over the outer dims, with the element offsets it implies on each side.
  int64_t index[kMaxBoxDims] = {};
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  for (int d = last - 1; d >= 0; --d) {
    index[d] = row % box.shape[d];
    row /= box.shape[d];
    src_offset += index[d] * box.src_stride[d];
    dst_offset += index[d] * box.dst_stride[d];
  }

  const auto* src = static_cast<const std::byte*>(box.src);
  auto* dst = static_cast<std::byte*>(box.dst);
  const int64_t src_inner = box.src_stride[last];
  const int64_t dst_inner = box.dst_stride[last];
  int64_t remaining = end - begin;
  for (;;) {
    const int64_t n = std::min(row_length - column, remaining);
    copy_run(src + (src_offset + column * src_inner) * box.src_elem_size, src_inner,
             dst + (dst_offset + column * dst_inner) * box.dst_elem_size, dst_inner, n,
             box.src_elem_size);
    remaining -= n;
    if (remaining == 0) { return; }
    column = 0;
    for (int d = last - 1; d >= 0; --d) {
      if (++index[d] < box.shape[d]) {
        src_offset += box.src_stride[d];
        dst_offset += box.dst_stride[d];
        break;
      }
      src_offset -= (box.shape[d] - 1) * box.src_stride[d];
      dst_offset -= (box.shape[d] - 1) * box.dst_stride[d];
      index[d] = 0;
    }
  }
}

/// Faults in the destination pages of elements [begin, end) of a simplified box when they are one
/// contiguous byte range (a 1-D box with unit destination stride: every staging copy); other
/// boxes are left to fault page by page.
void prefault_destination(const BoxCopy& box, int64_t begin, int64_t end)
{
  if (box.ndim != 1 || box.dst_stride[0] != 1 || end <= begin) { return; }
  auto* dst = static_cast<std::byte*>(box.dst) + begin * box.dst_elem_size;
  prefault_writable(dst, static_cast<size_t>(end - begin) * static_cast<size_t>(box.dst_elem_size));
}

// ---------------------------------------------------------------------------------------------
// Row groups: column slices of the same destination rows, copied row by row together
// ---------------------------------------------------------------------------------------------

/// Bytes from one destination row of a 2-D box to the next.
int64_t dst_pitch_bytes(const BoxCopy& box) { return box.dst_stride[0] * box.dst_elem_size; }

/// True for a simplified box whose rows may be copied interleaved with other boxes' rows: a
/// same-kind 2-D box of at least 2 rows, contiguous rows on both sides, not transposing.
bool is_row_group_candidate(const BoxCopy& box)
{
  return box_is_byte_copy(box) && box.ndim == 2 && box.shape[0] > 1 && box.src_stride[1] == 1 &&
         box.dst_stride[1] == 1 && !is_transposing(box);
}

/// Boxes copied together row by row: row r of every member in turn (members in destination
/// order), then row r + 1.
struct RowGroup {
  size_t first;       ///< index of the first member in the members list
  size_t count;       ///< number of members (at least 2)
  int64_t rows;       ///< rows of every member
  int64_t row_bytes;  ///< bytes of one row of all members together
};

/// Finds the row groups among simplified `boxes`: row-group candidates with the same number of
/// rows and the same destination pitch whose destinations start less than one pitch after the
/// first member's, in practice the column slices of one destination matrix (the two halves a
/// Shard(1) piece pair places). Copied slice by slice, such boxes write the destination as several
/// strided streams with a gap in every row; row by row together, as one forward stream.
/// A group's row stays within `grain_bytes` (a member that would take it over starts the next
/// group), so that every task of a group holds whole rows.
/// Grouping only changes the order of the writes: destinations are disjoint, so the bytes are the
/// same whichever boxes it groups. Appends every group's members, in destination order, to
/// `members` and sets `grouped[i]` for each; the other boxes keep the per-box plan.
std::vector<RowGroup> find_row_groups(const std::vector<BoxCopy>& boxes, size_t grain_bytes,
                                      std::vector<size_t>& members, std::vector<char>& grouped)
{
  const auto row_bytes = [&](size_t i) {
    return boxes[i].shape[1] * std::max(boxes[i].src_elem_size, boxes[i].dst_elem_size);
  };
  std::vector<size_t> candidates;
  for (size_t i = 0; i < boxes.size(); ++i) {
    if (is_row_group_candidate(boxes[i])) { candidates.push_back(i); }
  }
  const auto address = [&](size_t i) { return reinterpret_cast<uintptr_t>(boxes[i].dst); };
  std::sort(candidates.begin(), candidates.end(), [&](size_t a, size_t b) {
    const int64_t pitch_a = dst_pitch_bytes(boxes[a]);
    const int64_t pitch_b = dst_pitch_bytes(boxes[b]);
    if (pitch_a != pitch_b) { return pitch_a < pitch_b; }
    if (boxes[a].shape[0] != boxes[b].shape[0]) { return boxes[a].shape[0] < boxes[b].shape[0]; }
    return address(a) < address(b);
  });
  std::vector<RowGroup> groups;
  size_t i = 0;
  while (i < candidates.size()) {
    const BoxCopy& first = boxes[candidates[i]];
    const int64_t pitch = dst_pitch_bytes(first);
    int64_t group_row_bytes = row_bytes(candidates[i]);
    size_t end = i + 1;
    while (end < candidates.size() && dst_pitch_bytes(boxes[candidates[end]]) == pitch &&
           boxes[candidates[end]].shape[0] == first.shape[0] &&
           address(candidates[end]) - address(candidates[i]) < static_cast<uintptr_t>(pitch) &&
           static_cast<size_t>(group_row_bytes + row_bytes(candidates[end])) <= grain_bytes) {
      group_row_bytes += row_bytes(candidates[end]);
      ++end;
    }
    if (end - i >= 2) {
      groups.push_back({members.size(), end - i, first.shape[0], group_row_bytes});
      for (size_t k = i; k < end; ++k) {
        members.push_back(candidates[k]);
        grouped[candidates[k]] = 1;
      }
    }
    i = end;
  }
  return groups;
}

/// Copies rows [first_row, end_row) of every member of `group`: row r of each member in
/// destination order, then row r + 1. Preconditions: every member is a row-group candidate with
/// group.rows rows; `copiers[i]` is box i's run copier.
void copy_group_rows(const RowGroup& group, const std::vector<size_t>& members,
                     const std::vector<BoxCopy>& boxes, const std::vector<RunCopier>& copiers,
                     int64_t first_row, int64_t end_row)
{
  for (int64_t row = first_row; row < end_row; ++row) {
    for (size_t m = group.first; m < group.first + group.count; ++m) {
      const BoxCopy& box = boxes[members[m]];
      const auto* src = static_cast<const std::byte*>(box.src) + row * box.src_stride[0] * box.src_elem_size;
      auto* dst = static_cast<std::byte*>(box.dst) + row * box.dst_stride[0] * box.dst_elem_size;
      copiers[members[m]](src, 1, dst, 1, box.shape[1], box.src_elem_size);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Planning
// ---------------------------------------------------------------------------------------------

/// A contiguous part of the work, the unit the planner hands to tasks: elements [begin, end) of
/// (simplified) box `index`, or, with `row_group`, rows [begin, end) of row group `index`.
struct Segment {
  size_t index;
  int64_t begin;
  int64_t end;
  bool row_group;
};

/// Segments and the tasks they make: small work accumulates into the open task until it holds
/// about `grain_bytes`; work above the grain is cut into pieces that each get a task of their own.
class TaskPlan {
 public:
  explicit TaskPlan(size_t grain_bytes) : grain_bytes_(grain_bytes) {}

  /// Adds a whole box or row group of `bytes` (at most the grain) to the open task.
  void add_small(const Segment& segment, size_t bytes)
  {
    segments_.push_back(segment);
    open_bytes_ += bytes;
    if (open_bytes_ >= grain_bytes_) { close_task(); }
  }

  /// Adds [0, n) of box or row group `index` as pieces of `piece` (>= 1), a task each.
  void add_pieces(size_t index, bool row_group, int64_t n, int64_t piece)
  {
    for (int64_t begin = 0; begin < n; begin += piece) {
      close_task();
      segments_.push_back({index, begin, std::min(n, begin + piece), row_group});
    }
    close_task();
  }

  /// Ends the open task (if it holds anything).
  void close_task()
  {
    if (segments_.size() > task_first_segment_.back()) {
      task_first_segment_.push_back(segments_.size());
    }
    open_bytes_ = 0;
  }

  /// Number of tasks closed so far.
  size_t num_tasks() const { return task_first_segment_.size() - 1; }
  /// Segments of task `task`: [first_segment(task), first_segment(task + 1)).
  size_t first_segment(size_t task) const { return task_first_segment_[task]; }
  const Segment& segment(size_t s) const { return segments_[s]; }

 private:
  size_t grain_bytes_;
  size_t open_bytes_ = 0;
  std::vector<Segment> segments_;
  std::vector<size_t> task_first_segment_{0};
};

/// Elements per piece when a box larger than `grain_bytes` is split: whole rows when rows are
/// shorter than a piece (so pieces start at row starts), otherwise a multiple of 64 elements.
/// Transposing boxes always get whole tiles of rows, so that every piece can be walked tile by tile.
int64_t piece_elements(const BoxCopy& box, int64_t bytes_per_element, size_t grain_bytes)
{
  const int64_t per_piece =
    std::max<int64_t>(1, static_cast<int64_t>(grain_bytes) / bytes_per_element);
  const int64_t row_length = box.shape[box.ndim - 1];
  if (is_transposing(box)) {
    const int64_t rows = std::max<int64_t>(1, per_piece / row_length / kTransposeTile) * kTransposeTile;
    return rows * row_length;
  }
  if (row_length <= per_piece) { return per_piece / row_length * row_length; }
  return std::max<int64_t>(64, per_piece / 64 * 64);
}

[[noreturn]] void invalid_box(const std::string& what)
{
  throw std::invalid_argument("fastdcp box copy: " + what);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------------

int32_t scalar_kind_size(int32_t kind)
{
  switch (static_cast<ScalarKind>(kind)) {
    case ScalarKind::kBool:
    case ScalarKind::kUInt8:
    case ScalarKind::kInt8: return 1;
    case ScalarKind::kInt16:
    case ScalarKind::kFloat16:
    case ScalarKind::kBFloat16: return 2;
    case ScalarKind::kInt32:
    case ScalarKind::kFloat32: return 4;
    case ScalarKind::kInt64:
    case ScalarKind::kFloat64:
    case ScalarKind::kComplex64: return 8;
    case ScalarKind::kComplex128: return 16;
    default: return 0;
  }
}

bool box_kinds_supported(int32_t src_kind, int32_t dst_kind)
{
  if (src_kind == dst_kind) {
    return src_kind == static_cast<int32_t>(ScalarKind::kRawBytes) || scalar_kind_size(src_kind) > 0;
  }
  return is_convertible_kind(src_kind) && is_convertible_kind(dst_kind);
}

int64_t box_num_elements(const BoxCopy& box)
{
  int64_t n = 1;
  for (int d = 0; d < box.ndim; ++d) {
    n *= box.shape[d];
  }
  return n;
}

void validate_box(const BoxCopy& box)
{
  if (box.ndim < 0 || box.ndim > kMaxBoxDims) {
    invalid_box("ndim " + std::to_string(box.ndim) + " is outside [0, " +
                std::to_string(kMaxBoxDims) + "]");
  }
  for (int d = 0; d < box.ndim; ++d) {
    if (box.shape[d] < 0 || box.src_stride[d] < 0 || box.dst_stride[d] < 0) {
      invalid_box("negative shape or stride in dimension " + std::to_string(d));
    }
    if (box.dst_stride[d] == 0 && box.shape[d] > 1) {
      invalid_box("destination stride 0 in dimension " + std::to_string(d) + " of size " +
                  std::to_string(box.shape[d]));
    }
  }
  if (!box_kinds_supported(box.src_kind, box.dst_kind)) {
    invalid_box("unsupported kinds " + std::to_string(box.src_kind) + " -> " +
                std::to_string(box.dst_kind));
  }
  const auto check_size = [](int32_t kind, int32_t elem_size, const char* side) {
    const int32_t expected = scalar_kind_size(kind);
    if (elem_size <= 0 || (expected != 0 && elem_size != expected)) {
      invalid_box(std::string(side) + " element size " + std::to_string(elem_size) +
                  " does not match kind " + std::to_string(kind));
    }
  };
  check_size(box.src_kind, box.src_elem_size, "source");
  check_size(box.dst_kind, box.dst_elem_size, "destination");
  if (box.src_elem_size != box.dst_elem_size && box_is_byte_copy(box)) {
    invalid_box("raw byte copy between element sizes " + std::to_string(box.src_elem_size) +
                " and " + std::to_string(box.dst_elem_size));
  }
  if (box_num_elements(box) > 0 && (box.src == nullptr || box.dst == nullptr)) {
    invalid_box("null pointer in a non-empty box");
  }
}

void simplify_box(BoxCopy& box)
{
  int ndim = 0;
  bool empty = false;
  for (int d = 0; d < box.ndim; ++d) {
    if (box.shape[d] == 0) { empty = true; }
    if (box.shape[d] == 1) { continue; }  // a size-1 dim contributes no offset
    box.shape[ndim] = box.shape[d];
    box.src_stride[ndim] = box.src_stride[d];
    box.dst_stride[ndim] = box.dst_stride[d];
    ++ndim;
  }
  if (empty || ndim == 0) {
    box.ndim = 1;
    box.shape[0] = empty ? 0 : 1;
    box.src_stride[0] = 1;
    box.dst_stride[0] = 1;
    return;
  }

  // Stable insertion sort by decreasing destination stride (then source stride): iteration order
  // does not change the result, and walking the destination forward keeps writes streaming and
  // lets a view that is transposed on both sides collapse into one contiguous run.
  for (int i = 1; i < ndim; ++i) {
    for (int j = i; j > 0; --j) {
      const bool out_of_order =
        box.dst_stride[j - 1] < box.dst_stride[j] ||
        (box.dst_stride[j - 1] == box.dst_stride[j] && box.src_stride[j - 1] < box.src_stride[j]);
      if (!out_of_order) { break; }
      std::swap(box.shape[j - 1], box.shape[j]);
      std::swap(box.src_stride[j - 1], box.src_stride[j]);
      std::swap(box.dst_stride[j - 1], box.dst_stride[j]);
    }
  }

  // Merge an outer dim into the inner one when stepping the outer dim equals stepping over the
  // whole inner dim on both sides.
  int merged = 0;
  for (int d = 1; d < ndim; ++d) {
    const bool contiguous = box.src_stride[merged] == box.src_stride[d] * box.shape[d] &&
                            box.dst_stride[merged] == box.dst_stride[d] * box.shape[d];
    if (contiguous) {
      box.shape[merged] *= box.shape[d];
      box.src_stride[merged] = box.src_stride[d];
      box.dst_stride[merged] = box.dst_stride[d];
    } else {
      ++merged;
      box.shape[merged] = box.shape[d];
      box.src_stride[merged] = box.src_stride[d];
      box.dst_stride[merged] = box.dst_stride[d];
    }
  }
  box.ndim = merged + 1;
}

int64_t box_element_prefix(const BoxCopy* boxes, size_t num_boxes, int64_t* prefix)
{
  prefix[0] = 0;
  for (size_t i = 0; i < num_boxes; ++i) {
    prefix[i + 1] = prefix[i] + box_num_elements(boxes[i]);
  }
  return prefix[num_boxes];
}

void box_copy_cpu(const BoxCopy* boxes, size_t num_boxes, ThreadPool& pool, size_t grain_bytes,
                  bool streaming, bool prefault)
{
  if (num_boxes == 0) { return; }
  grain_bytes = std::max<size_t>(grain_bytes, 1);

  std::vector<BoxCopy> simplified(boxes, boxes + num_boxes);
  std::vector<RunCopier> copiers(num_boxes);
  for (size_t i = 0; i < num_boxes; ++i) {
    validate_box(simplified[i]);
    simplify_box(simplified[i]);
    copiers[i] = run_copier_for(simplified[i], streaming);
  }

  std::vector<size_t> members;
  std::vector<char> grouped(num_boxes, 0);
  const std::vector<RowGroup> groups = find_row_groups(simplified, grain_bytes, members, grouped);

  TaskPlan plan(grain_bytes);
  for (size_t g = 0; g < groups.size(); ++g) {
    const RowGroup& group = groups[g];
    const auto bytes = static_cast<size_t>(group.rows) * static_cast<size_t>(group.row_bytes);
    if (bytes <= grain_bytes) {
      plan.add_small({g, 0, group.rows, true}, bytes);
    } else {
      plan.add_pieces(g, true, group.rows, static_cast<int64_t>(grain_bytes) / group.row_bytes);
    }
  }
  for (size_t i = 0; i < num_boxes; ++i) {
    const BoxCopy& box = simplified[i];
    const int64_t n = box_num_elements(box);
    if (n == 0 || grouped[i]) { continue; }
    const int64_t bytes_per_element = std::max(box.src_elem_size, box.dst_elem_size);
    const auto bytes = static_cast<size_t>(n) * static_cast<size_t>(bytes_per_element);
    if (bytes <= grain_bytes) {
      plan.add_small({i, 0, n, false}, bytes);
    } else {
      plan.add_pieces(i, false, n, piece_elements(box, bytes_per_element, grain_bytes));
    }
  }
  plan.close_task();

  const size_t num_tasks = plan.num_tasks();
  const auto run_task = [&](size_t task, int /*worker*/) {
    for (size_t s = plan.first_segment(task); s < plan.first_segment(task + 1); ++s) {
      const Segment& seg = plan.segment(s);
      if (seg.row_group) {
        copy_group_rows(groups[seg.index], members, simplified, copiers, seg.begin, seg.end);
        continue;
      }
      if (prefault) { prefault_destination(simplified[seg.index], seg.begin, seg.end); }
      copy_box_range(simplified[seg.index], copiers[seg.index], seg.begin, seg.end);
    }
  };
  if (num_tasks == 1) {
    run_task(0, 0);  // not worth a hand-off to the pool
  } else if (num_tasks > 1) {
    pool.run_batch(num_tasks, run_task);
  }
}

}  // namespace fastdcp
