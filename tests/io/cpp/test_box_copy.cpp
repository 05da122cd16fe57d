// Tests of the CPU batched box copy (csrc/box_copy.cpp). A plain program; from the repository root:
//   g++ -std=c++17 -O2 -pthread -I csrc tests/io/cpp/test_box_copy.cpp csrc/box_copy.cpp
//       csrc/prefault.cpp csrc/stream_copy.cpp csrc/thread_pool.cpp -o test_box_copy
// It prints "N passed, M failed" and exits non-zero when anything failed.
#include "paged_buffer.hpp"
#include "box_copy.hpp"
#include "thread_pool.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

using namespace fastdcp;

namespace {

int g_passed = 0;
int g_failed = 0;

#define CHECK(cond)                                                                \
  do {                                                                             \
    if (cond) {                                                                    \
      ++g_passed;                                                                  \
    } else {                                                                       \
      ++g_failed;                                                                  \
      std::fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond);        \
    }                                                                              \
  } while (0)

#define CHECK_EQ_HEX(actual, expected)                                                        \
  do {                                                                                        \
    const auto a_ = static_cast<unsigned long long>(actual);                                  \
    const auto e_ = static_cast<unsigned long long>(expected);                                \
    if (a_ == e_) {                                                                           \
      ++g_passed;                                                                             \
    } else {                                                                                  \
      ++g_failed;                                                                             \
      std::fprintf(stderr, "FAILED %s:%d: %s == 0x%llx, expected 0x%llx\n", __FILE__, __LINE__, \
                   #actual, a_, e_);                                                          \
    }                                                                                         \
  } while (0)

constexpr auto kRaw = static_cast<int32_t>(ScalarKind::kRawBytes);
constexpr auto kBool = static_cast<int32_t>(ScalarKind::kBool);
constexpr auto kU8 = static_cast<int32_t>(ScalarKind::kUInt8);
constexpr auto kI8 = static_cast<int32_t>(ScalarKind::kInt8);
constexpr auto kI16 = static_cast<int32_t>(ScalarKind::kInt16);
constexpr auto kI32 = static_cast<int32_t>(ScalarKind::kInt32);
constexpr auto kI64 = static_cast<int32_t>(ScalarKind::kInt64);
constexpr auto kF16 = static_cast<int32_t>(ScalarKind::kFloat16);
constexpr auto kBF16 = static_cast<int32_t>(ScalarKind::kBFloat16);
constexpr auto kF32 = static_cast<int32_t>(ScalarKind::kFloat32);
constexpr auto kF64 = static_cast<int32_t>(ScalarKind::kFloat64);
constexpr auto kC64 = static_cast<int32_t>(ScalarKind::kComplex64);
constexpr auto kC128 = static_cast<int32_t>(ScalarKind::kComplex128);

constexpr int32_t kRealKinds[] = {kBool, kU8, kI8, kI16, kI32, kI64, kF16, kBF16, kF32, kF64};

BoxCopy make_box(const void* src, void* dst, int32_t src_kind, int32_t dst_kind,
                 std::vector<int64_t> shape, std::vector<int64_t> src_stride,
                 std::vector<int64_t> dst_stride, int32_t raw_elem_size = 0)
{
  BoxCopy box{};
  box.src = src;
  box.dst = dst;
  box.ndim = static_cast<int32_t>(shape.size());
  box.src_kind = src_kind;
  box.dst_kind = dst_kind;
  box.src_elem_size = src_kind == kRaw ? raw_elem_size : scalar_kind_size(src_kind);
  box.dst_elem_size = dst_kind == kRaw ? raw_elem_size : scalar_kind_size(dst_kind);
  for (size_t d = 0; d < shape.size(); ++d) {
    box.shape[d] = shape[d];
    box.src_stride[d] = src_stride[d];
    box.dst_stride[d] = dst_stride[d];
  }
  return box;
}

/// Calls `visit(src_offset, dst_offset)` (in elements) for every element of `box`: the obvious
/// reference the optimised copy is compared with.
void for_each_element(const BoxCopy& box, const std::function<void(int64_t, int64_t)>& visit)
{
  const int64_t n = box_num_elements(box);
  for (int64_t e = 0; e < n; ++e) {
    int64_t rest = e;
    int64_t src_offset = 0;
    int64_t dst_offset = 0;
    for (int d = box.ndim - 1; d >= 0; --d) {
      const int64_t index = rest % box.shape[d];
      rest /= box.shape[d];
      src_offset += index * box.src_stride[d];
      dst_offset += index * box.dst_stride[d];
    }
    visit(src_offset, dst_offset);
  }
}

/// True when every element of the same-kind `box` arrived at its place.
bool box_landed(const BoxCopy& box)
{
  bool ok = true;
  for_each_element(box, [&](int64_t s, int64_t d) {
    const auto* src = static_cast<const char*>(box.src) + s * box.src_elem_size;
    const auto* dst = static_cast<const char*>(box.dst) + d * box.dst_elem_size;
    ok = ok && std::memcmp(src, dst, box.src_elem_size) == 0;
  });
  return ok;
}

template <typename T>
std::vector<T> iota_vector(size_t n, T start = T{1})
{
  std::vector<T> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

/// Converts one element with box_copy_cpu and returns the destination bytes.
template <typename Dst, typename Src>
Dst convert_one(ThreadPool& pool, Src value, int32_t src_kind, int32_t dst_kind)
{
  Dst out{};
  BoxCopy box = make_box(&value, &out, src_kind, dst_kind, {}, {}, {});
  box_copy_cpu(&box, 1, pool);
  return out;
}

float float_of(uint32_t b)
{
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// ---------------------------------------------------------------------------------------------

void test_simplify()
{
  {  // a fully contiguous 3-D box becomes 1-D with unit strides
    BoxCopy box = make_box(nullptr, nullptr, kF32, kF32, {4, 5, 6}, {30, 6, 1}, {30, 6, 1});
    simplify_box(box);
    CHECK(box.ndim == 1 && box.shape[0] == 120 && box.src_stride[0] == 1 && box.dst_stride[0] == 1);
  }
  {  // size-1 dims are dropped; a narrowed outer dim still merges with full inner dims
    BoxCopy box = make_box(nullptr, nullptr, kF32, kF32, {1, 3, 1, 8}, {999, 8, 77, 1}, {5, 8, 3, 1});
    simplify_box(box);
    CHECK(box.ndim == 1 && box.shape[0] == 24);
  }
  {  // Shard(0) -> Shard(1): rows of a wider source land in a narrower destination: stays 2-D
    BoxCopy box = make_box(nullptr, nullptr, kF32, kF32, {64, 512}, {1024, 1}, {512, 1});
    simplify_box(box);
    CHECK(box.ndim == 2 && box.shape[0] == 64 && box.shape[1] == 512 && box.src_stride[0] == 1024);
  }
  {  // transposed on both sides: reordering by destination stride makes it one contiguous run
    BoxCopy box = make_box(nullptr, nullptr, kF32, kF32, {7, 9}, {1, 7}, {1, 7});
    simplify_box(box);
    CHECK(box.ndim == 1 && box.shape[0] == 63 && box.src_stride[0] == 1 && box.dst_stride[0] == 1);
  }
  {  // transposed source only: the destination's order is kept
    BoxCopy box = make_box(nullptr, nullptr, kF32, kF32, {7, 9}, {1, 7}, {9, 1});
    simplify_box(box);
    CHECK(box.ndim == 2 && box.shape[0] == 7 && box.dst_stride[1] == 1 && box.src_stride[1] == 7);
  }
  {  // 0-d and all-size-1 boxes become 1-D of length 1
    BoxCopy box = make_box(nullptr, nullptr, kF32, kF32, {}, {}, {});
    simplify_box(box);
    CHECK(box.ndim == 1 && box.shape[0] == 1);
    BoxCopy ones = make_box(nullptr, nullptr, kF32, kF32, {1, 1}, {5, 3}, {2, 9});
    simplify_box(ones);
    CHECK(ones.ndim == 1 && ones.shape[0] == 1);
  }
  {  // an empty box stays empty
    BoxCopy box = make_box(nullptr, nullptr, kF32, kF32, {3, 0, 2}, {6, 2, 1}, {6, 2, 1});
    simplify_box(box);
    CHECK(box.ndim == 1 && box.shape[0] == 0 && box_num_elements(box) == 0);
  }
  {  // simplify is idempotent
    BoxCopy box = make_box(nullptr, nullptr, kF32, kF32, {3, 4, 5}, {100, 20, 2}, {1, 15, 3});
    simplify_box(box);
    BoxCopy again = box;
    simplify_box(again);
    CHECK(std::memcmp(&box, &again, sizeof(BoxCopy)) == 0);
  }
}

void test_validate()
{
  float f = 0;
  double d = 0;
  const auto rejects = [](BoxCopy box) {
    try {
      validate_box(box);
    } catch (const std::invalid_argument&) {
      return true;
    }
    return false;
  };
  CHECK(!rejects(make_box(&f, &d, kF32, kF64, {}, {}, {})));
  BoxCopy too_many = make_box(&f, &f, kF32, kF32, {}, {}, {});
  too_many.ndim = kMaxBoxDims + 1;
  CHECK(rejects(too_many));
  CHECK(rejects(make_box(&f, &f, kF32, kF32, {2}, {-1}, {1})));
  CHECK(rejects(make_box(&f, &f, kF32, kF32, {2}, {1}, {0})));            // writes twice
  CHECK(!rejects(make_box(&f, &f, kF32, kF32, {2}, {0}, {1})));           // broadcast source
  CHECK(rejects(make_box(&f, &f, kC64, kF32, {}, {}, {})));               // complex: copy only
  CHECK(rejects(make_box(&f, &f, kC64, kC128, {}, {}, {})));
  CHECK(!rejects(make_box(&f, &f, kC128, kC128, {}, {}, {})));
  CHECK(rejects(make_box(&f, &f, kRaw, kF32, {}, {}, {}, 4)));            // raw: same kind only
  CHECK(rejects(make_box(&f, &f, 99, 99, {}, {}, {})));                   // unknown kind
  BoxCopy raw_sizes = make_box(&f, &f, kRaw, kRaw, {}, {}, {}, 4);
  raw_sizes.dst_elem_size = 2;
  CHECK(rejects(raw_sizes));
  BoxCopy wrong_size = make_box(&f, &f, kF32, kF32, {}, {}, {});
  wrong_size.src_elem_size = 2;
  CHECK(rejects(wrong_size));
  CHECK(rejects(make_box(nullptr, &f, kF32, kF32, {1}, {1}, {1})));
  CHECK(!rejects(make_box(nullptr, nullptr, kF32, kF32, {0}, {1}, {1})));  // empty: pointers unused

  // A batch with one bad box copies nothing at all.
  ThreadPool pool(2);
  float src = 1.0f;
  float dst = 0.0f;
  BoxCopy batch[2] = {make_box(&src, &dst, kF32, kF32, {}, {}, {}),
                      make_box(&src, &dst, kF32, kF32, {2}, {1}, {0})};
  bool threw = false;
  try {
    box_copy_cpu(batch, 2, pool);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw && dst == 0.0f);

  CHECK(box_kinds_supported(kF32, kBF16) && box_kinds_supported(kBool, kF64));
  CHECK(box_kinds_supported(kRaw, kRaw) && !box_kinds_supported(kRaw, kU8));
  CHECK(scalar_kind_size(kBF16) == 2 && scalar_kind_size(kC128) == 16 && scalar_kind_size(kRaw) == 0);
}

void test_prefix()
{
  std::vector<BoxCopy> boxes = {make_box(nullptr, nullptr, kF32, kF32, {}, {}, {}),
                                make_box(nullptr, nullptr, kF32, kF32, {3, 4}, {4, 1}, {4, 1}),
                                make_box(nullptr, nullptr, kF32, kF32, {0}, {1}, {1}),
                                make_box(nullptr, nullptr, kF32, kF32, {5}, {1}, {1})};
  int64_t prefix[5] = {-1, -1, -1, -1, -1};
  CHECK(box_element_prefix(boxes.data(), boxes.size(), prefix) == 18);
  CHECK(prefix[0] == 0 && prefix[1] == 1 && prefix[2] == 13 && prefix[3] == 13 && prefix[4] == 18);
}

void test_zero_d(ThreadPool& pool)
{
  const double src = 2.75;
  double dst = 0;
  BoxCopy box = make_box(&src, &dst, kF64, kF64, {}, {}, {});
  box_copy_cpu(&box, 1, pool);
  CHECK(dst == 2.75);
  CHECK(convert_one<int32_t>(pool, 2.75, kF64, kI32) == 2);
  // Empty batches and empty boxes are no-ops.
  box_copy_cpu(nullptr, 0, pool);
  int untouched = 7;
  BoxCopy empty = make_box(&src, &untouched, kI32, kI32, {4, 0}, {1, 1}, {1, 1});
  box_copy_cpu(&empty, 1, pool);
  CHECK(untouched == 7);
}

void test_contiguous_1d(ThreadPool& pool)
{
  const auto src = iota_vector<int32_t>(1000);
  std::vector<int32_t> dst(1000, 0);
  BoxCopy box = make_box(src.data(), dst.data(), kI32, kI32, {1000}, {1}, {1});
  box_copy_cpu(&box, 1, pool);
  CHECK(dst == src);

  // Source bytes at an odd address (tensor data at an odd file offset in a staging buffer).
  std::vector<char> staging(1 + 1000 * sizeof(float));
  for (int i = 0; i < 1000; ++i) {
    const float v = static_cast<float>(i) * 0.5f;
    std::memcpy(staging.data() + 1 + i * sizeof(float), &v, sizeof(float));
  }
  std::vector<float> floats(1000);
  std::vector<double> doubles(1000);
  BoxCopy same = make_box(staging.data() + 1, floats.data(), kF32, kF32, {1000}, {1}, {1});
  BoxCopy widen = make_box(staging.data() + 1, doubles.data(), kF32, kF64, {1000}, {1}, {1});
  BoxCopy both[2] = {same, widen};
  box_copy_cpu(both, 2, pool);
  bool ok = true;
  for (int i = 0; i < 1000; ++i) {
    ok = ok && floats[i] == static_cast<float>(i) * 0.5f && doubles[i] == i * 0.5;
  }
  CHECK(ok);

  // Raw elements of an odd size (say a 3-byte dtype) are copied as opaque bytes.
  const auto bytes = iota_vector<uint8_t>(300, 0);
  std::vector<uint8_t> out(300, 0);
  BoxCopy raw = make_box(bytes.data(), out.data(), kRaw, kRaw, {100}, {1}, {1}, 3);
  box_copy_cpu(&raw, 1, pool);
  CHECK(out == bytes);
}

void test_transposed_2d(ThreadPool& pool)
{
  // The stored chunk is x.T of a 37x53 tensor (stock DCP keeps non-contiguous strides); copy the
  // 53x37 view into a contiguous destination.
  constexpr int64_t kRows = 37;
  constexpr int64_t kCols = 53;
  const auto src = iota_vector<float>(kRows * kCols);
  std::vector<float> dst(kRows * kCols, -1.0f);
  BoxCopy box = make_box(src.data(), dst.data(), kF32, kF32, {kCols, kRows}, {1, kCols}, {kRows, 1});
  box_copy_cpu(&box, 1, pool, 256);  // small grain: pieces split rows too
  bool ok = true;
  for (int64_t i = 0; i < kCols; ++i) {
    for (int64_t j = 0; j < kRows; ++j) {
      ok = ok && dst[i * kRows + j] == src[j * kCols + i];
    }
  }
  CHECK(ok);

  // A larger transposed box with ragged tile edges, cut into pieces of 32 rows on the workers.
  constexpr int64_t kBigRows = 300;
  constexpr int64_t kBigCols = 203;
  const auto big_src = iota_vector<int16_t>(kBigRows * kBigCols);
  std::vector<int16_t> big_dst(kBigRows * kBigCols, -1);
  BoxCopy big = make_box(big_src.data(), big_dst.data(), kI16, kI16, {kBigCols, kBigRows},
                         {1, kBigCols}, {kBigRows, 1});
  box_copy_cpu(&big, 1, pool, 4096);
  CHECK(box_landed(big));

  // And converting on the way (f32 -> f64) through the same strided walk.
  std::vector<double> wide(kRows * kCols, -1.0);
  BoxCopy widen = make_box(src.data(), wide.data(), kF32, kF64, {kCols, kRows}, {1, kCols}, {kRows, 1});
  box_copy_cpu(&widen, 1, pool, 256);
  ok = true;
  for (int64_t i = 0; i < kCols; ++i) {
    for (int64_t j = 0; j < kRows; ++j) {
      ok = ok && wide[i * kRows + j] == static_cast<double>(src[j * kCols + i]);
    }
  }
  CHECK(ok);
}

void test_3d_with_gaps(ThreadPool& pool)
{
  // src[1:4, 2:5, 1:6] of a 5x6x7 tensor -> dst[0:3, 1:4, 2:7] of a 4x5x8 tensor.
  const auto src = iota_vector<int64_t>(5 * 6 * 7, 0);  // value == flat source index
  std::vector<int64_t> dst(4 * 5 * 8, -1);
  const int64_t* src_origin = src.data() + (1 * 6 + 2) * 7 + 1;
  int64_t* dst_origin = dst.data() + (0 * 5 + 1) * 8 + 2;
  BoxCopy box = make_box(src_origin, dst_origin, kI64, kI64, {3, 3, 5}, {42, 7, 1}, {40, 8, 1});
  box_copy_cpu(&box, 1, pool);
  CHECK(box_landed(box));
  // Everything outside the box is untouched.
  int64_t touched = 0;
  for (int64_t v : dst) {
    touched += v != -1;
  }
  CHECK(touched == 3 * 3 * 5);
  CHECK(dst[(0 * 5 + 1) * 8 + 2] == (1 * 6 + 2) * 7 + 1);
  CHECK(dst[(2 * 5 + 3) * 8 + 6] == (3 * 6 + 4) * 7 + 5);
}

void test_two_kib_rows(ThreadPool& pool)
{
  // Shard(0) -> Shard(1) of an 128x1024 fp32 tensor at world size 2: the staging buffer holds the
  // saved rows [64, 128) (all 1024 columns); the local chunk is columns [512, 1024) of every row.
  // Every row of the box is one 2 KiB run.
  constexpr int64_t kCols = 1024;
  constexpr int64_t kLocalCols = 512;
  const auto staging = iota_vector<float>(64 * kCols);
  std::vector<float> local(128 * kLocalCols, -1.0f);
  BoxCopy box = make_box(staging.data() + kLocalCols, local.data() + 64 * kLocalCols, kF32, kF32,
                         {64, kLocalCols}, {kCols, 1}, {kLocalCols, 1});
  box_copy_cpu(&box, 1, pool, 16 << 10);  // 8 rows per task
  CHECK(box_landed(box));
  CHECK(local[64 * kLocalCols] == staging[kLocalCols]);
  CHECK(local[64 * kLocalCols - 1] == -1.0f);  // the other saved chunk's rows are not touched
  CHECK(local[128 * kLocalCols - 1] == staging[64 * kCols - 1]);
}


void test_column_halves(ThreadPool& pool)
{
  // What a Shard(1) load places: a contiguous staging buffer holds the two column halves of a
  // matrix one after the other, and each half goes to every row of the destination, whose rows are
  // strided by the full width. With both buffers at the same page offset, every row whose byte
  // offset is a multiple of 4 KiB on both sides shares its page offset with its source (the rows
  // forward_copy copies itself); the others go to memcpy. Element sizes 1 to 16 bytes, half rows
  // from just above forward_copy's minimum to more than a page, lengths that are not multiples of
  // 16 bytes, page offsets that are not element-aligned, 1100 rows (rows 0, 512 and 1024 share
  // their page offset even for the odd lengths), tasks of a few rows, with and without streaming.
  constexpr unsigned char kFill = 0xEE;
  constexpr int64_t kRows = 1100;
  struct Case {
    int32_t elem_size;
    int64_t half_cols;
    size_t page_offset;
  };
  const Case cases[] = {{1, 257, 0}, {2, 1024, 0}, {2, 1044, 1}, {4, 1024, 64},
                        {8, 261, 0}, {16, 130, 3},  {2, 2048, 0}, {4, 77, 0}};
  for (const Case& c : cases) {
    for (bool streaming : {false, true}) {
      const int64_t half_bytes = c.half_cols * c.elem_size;
      const size_t matrix_bytes = static_cast<size_t>(kRows * 2 * half_bytes);
      PagedBuffer src(matrix_bytes, c.page_offset, 0);
      for (size_t i = 0; i < matrix_bytes; ++i) {
        src.data[i] = static_cast<unsigned char>(i * 131 + (i >> 9) + 7);
      }
      PagedBuffer dst(matrix_bytes, c.page_offset, kFill);
      BoxCopy halves[2];
      for (int h = 0; h < 2; ++h) {
        halves[h] = make_box(src.data + h * kRows * half_bytes, dst.data + h * half_bytes, kRaw, kRaw,
                             {kRows, c.half_cols}, {c.half_cols, 1}, {2 * c.half_cols, 1}, c.elem_size);
      }
      box_copy_cpu(halves, 2, pool, 16 << 10, streaming);
      bool ok = true;
      for (int64_t r = 0; r < kRows; ++r) {
        for (int h = 0; h < 2; ++h) {
          ok = ok && std::memcmp(dst.data + (r * 2 + h) * half_bytes,
                                 src.data + (h * kRows + r) * half_bytes, half_bytes) == 0;
        }
      }
      CHECK(ok);
      CHECK(dst.guards_intact(kFill));
    }
  }

  // A converting column half (f32 staging into the right half of a bf16 matrix) next to a
  // same-kind one (f32 into the left half of an f32 matrix), in one batch.
  constexpr int64_t kHalf = 300;
  std::vector<float> staging(kRows * kHalf);
  for (size_t i = 0; i < staging.size(); ++i) {
    staging[i] = float_of(0x3f800000u | ((static_cast<uint32_t>(i) * 4099u) & 0x7fffffu));  // in [1, 2)
  }
  std::vector<uint16_t> narrow(kRows * 2 * kHalf, 0xFFFF);
  std::vector<float> wide(kRows * 2 * kHalf, -1.0f);
  BoxCopy mixed[2] = {
    make_box(staging.data(), narrow.data() + kHalf, kF32, kBF16, {kRows, kHalf}, {kHalf, 1}, {2 * kHalf, 1}),
    make_box(staging.data(), wide.data(), kF32, kF32, {kRows, kHalf}, {kHalf, 1}, {2 * kHalf, 1})};
  box_copy_cpu(mixed, 2, pool, 16 << 10);
  bool ok = true;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t col = 0; col < kHalf; ++col) {
      const float v = staging[r * kHalf + col];
      ok = ok && narrow[r * 2 * kHalf + kHalf + col] == float_to_bfloat16_bits(v);
      ok = ok && narrow[r * 2 * kHalf + col] == 0xFFFF;
      ok = ok && wide[r * 2 * kHalf + col] == v && wide[r * 2 * kHalf + kHalf + col] == -1.0f;
    }
  }
  CHECK(ok);
}

void test_row_groups(ThreadPool& pool)
{
  // Boxes that are column slices of the same destination rows are copied row by row together
  // (row groups). The bytes must be the same whatever is grouped and however the groups are cut:
  // four uneven column slices of a bf16 matrix passed in shuffled order, next to a slice with
  // another row count, a 1-D box and a transposed box (none of which join a group); two slices
  // in different rows less than a pitch apart (grouped too); with grains that put a whole group
  // in one task with the 1-D box, cut groups into pieces of rows, and cut a group's row in two
  // (a member that would take the row past the grain starts a group of its own); with streaming
  // and with prefaulting.
  constexpr unsigned char kFill = 0xEE;
  constexpr int64_t kRows = 96;
  constexpr int64_t kCols = 1024;  // bf16: 2 KiB destination rows
  const int64_t widths[] = {100, 300, 7, 417};  // columns 200 to 1024
  const size_t matrix_bytes = kRows * kCols * 2;
  for (size_t grain : {size_t{1} << 20, size_t{16} << 10, size_t{1200}}) {
    for (int mode = 0; mode < 3; ++mode) {
      const bool streaming = mode == 1;
      const bool prefault = mode == 2;
      PagedBuffer src(3 * matrix_bytes, 0, 0);
      for (size_t i = 0; i < src.size; ++i) {
        src.data[i] = static_cast<unsigned char>(i * 97 + (i >> 10) + 1);
      }
      PagedBuffer dst(3 * matrix_bytes, 0, kFill);
      std::vector<BoxCopy> boxes;
      // Another row count: the same pitch, the first 200 columns of the first kRows / 2 rows,
      // less than a pitch before the slices, but not grouped with them.
      constexpr int64_t kLeft = 200;
      boxes.push_back(make_box(src.data, dst.data, kBF16, kBF16, {kRows / 2, kLeft}, {kLeft, 1},
                               {kCols, 1}));
      int64_t src_offset = kRows / 2 * kLeft * 2;
      int64_t column = kLeft;
      for (int64_t width : widths) {
        boxes.push_back(make_box(src.data + src_offset, dst.data + column * 2, kBF16, kBF16,
                                 {kRows, width}, {width, 1}, {kCols, 1}));
        src_offset += kRows * width * 2;
        column += width;
      }
      std::swap(boxes[1], boxes[4]);
      std::swap(boxes[2], boxes[3]);
      // Two slices of the second matrix, 40 rows each, one starting a row below the other's
      // start row and less than a pitch after it in memory.
      unsigned char* second = dst.data + matrix_bytes;
      boxes.push_back(make_box(src.data + src_offset, second + 600 * 2, kBF16, kBF16, {40, 400},
                               {400, 1}, {kCols, 1}));
      src_offset += 40 * 400 * 2;
      boxes.push_back(make_box(src.data + src_offset, second + (kCols + 100) * 2, kBF16, kBF16,
                               {40, 300}, {300, 1}, {kCols, 1}));
      src_offset += 40 * 300 * 2;
      // A 1-D box and a transposed box into the third matrix.
      unsigned char* third = dst.data + 2 * matrix_bytes;
      boxes.push_back(make_box(src.data + src_offset, third, kBF16, kBF16, {500}, {1}, {1}));
      src_offset += 500 * 2;
      boxes.push_back(make_box(src.data + src_offset, third + 1024, kBF16, kBF16, {32, 48}, {1, 32},
                               {48, 1}));
      box_copy_cpu(boxes.data(), boxes.size(), pool, grain, streaming, prefault);
      bool ok = true;
      for (const BoxCopy& box : boxes) {
        ok = ok && box_landed(box);
      }
      CHECK(ok);
      // Bytes no box covers keep the fill: the left part of the rows past kRows / 2 of the first
      // matrix, and everything around the slices of the second.
      CHECK(dst.data[(kRows / 2) * kCols * 2] == kFill && dst.data[(kRows - 1) * kCols * 2] == kFill);
      CHECK(second[600 * 2 - 1] == kFill && second[1000 * 2] == kFill);
      CHECK(second[(kCols + 99) * 2] == kFill && second[(kCols + 400) * 2] == kFill);
      CHECK(dst.guards_intact(kFill));
    }
  }
}

void test_many_small_boxes(ThreadPool& pool)
{
  // 5000 tensors of 64 floats packed back to back in one staging buffer, each going to its own
  // destination; every 10th is loaded into a bf16 tensor instead.
  constexpr int kTensors = 5000;
  constexpr int kElems = 64;
  std::vector<float> staging(kTensors * kElems);
  for (size_t i = 0; i < staging.size(); ++i) {
    staging[i] = static_cast<float>(i % 4096);  // most need rounding to fit bf16's 8 bits
  }
  std::vector<std::vector<float>> dst_f32(kTensors, std::vector<float>(kElems, -1.0f));
  std::vector<std::vector<uint16_t>> dst_bf16(kTensors, std::vector<uint16_t>(kElems, 0));
  std::vector<BoxCopy> boxes;
  for (int t = 0; t < kTensors; ++t) {
    const float* src = staging.data() + t * kElems;
    if (t % 10 == 0) {
      boxes.push_back(make_box(src, dst_bf16[t].data(), kF32, kBF16, {kElems}, {1}, {1}));
    } else {
      boxes.push_back(make_box(src, dst_f32[t].data(), kF32, kF32, {8, 8}, {8, 1}, {8, 1}));
    }
  }
  box_copy_cpu(boxes.data(), boxes.size(), pool, 64 << 10);
  bool ok = true;
  for (int t = 0; t < kTensors; ++t) {
    for (int i = 0; i < kElems; ++i) {
      const float expected = staging[t * kElems + i];
      if (t % 10 == 0) {
        ok = ok && dst_bf16[t][i] == float_to_bfloat16_bits(expected);
      } else {
        ok = ok && dst_f32[t][i] == expected;
      }
    }
  }
  CHECK(ok);
}

void test_large_split_boxes(ThreadPool& pool)
{
  // A 32 MiB contiguous box cut into 1 MiB pieces running on all workers.
  constexpr int64_t kLarge = 8 << 20;
  const auto src = iota_vector<int32_t>(kLarge);
  std::vector<int32_t> dst(kLarge, 0);
  BoxCopy box = make_box(src.data(), dst.data(), kI32, kI32, {kLarge}, {1}, {1});
  box_copy_cpu(&box, 1, pool, 1 << 20);
  CHECK(dst == src);

  // The same with streaming stores, into a destination one element off a cache line, with the
  // pieces' ends off lines too (grain not a multiple of 64); a strided box in the same batch
  // still copies element by element.
  std::vector<int32_t> off_line(kLarge + 1, -1);
  const auto strided_src = iota_vector<int32_t>(2 * 1000);
  std::vector<int32_t> strided_dst(1000, -1);
  BoxCopy batch[2] = {make_box(src.data(), off_line.data() + 1, kI32, kI32, {kLarge}, {1}, {1}),
                      make_box(strided_src.data(), strided_dst.data(), kI32, kI32, {1000}, {2}, {1})};
  box_copy_cpu(batch, 2, pool, (1 << 20) + 12, /*streaming=*/true);
  CHECK(off_line[0] == -1 && std::equal(src.begin(), src.end(), off_line.begin() + 1));
  CHECK(box_landed(batch[1]));

  // A strided 2-D box whose rows (3000 elements) are longer than a piece: pieces start mid-row.
  constexpr int64_t kRows = 700;
  constexpr int64_t kRowLen = 3000;
  const auto wide = iota_vector<int64_t>(kRows * (kRowLen + 5));
  std::vector<int64_t> narrow(kRows * kRowLen, -1);
  BoxCopy strided = make_box(wide.data() + 5, narrow.data(), kI64, kI64, {kRows, kRowLen},
                             {kRowLen + 5, 1}, {kRowLen, 1});
  box_copy_cpu(&strided, 1, pool, 4000);
  CHECK(box_landed(strided));

  // A large converting box (f32 -> bf16) split the same way agrees with the scalar rounding.
  std::vector<float> values(3 << 20);
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = float_of(static_cast<uint32_t>(i * 2654435761u));  // spread over all bit patterns
  }
  std::vector<uint16_t> rounded(values.size(), 0);
  BoxCopy narrowing = make_box(values.data(), rounded.data(), kF32, kBF16,
                               {static_cast<int64_t>(values.size())}, {1}, {1});
  box_copy_cpu(&narrowing, 1, pool, 1 << 20);
  bool ok = true;
  for (size_t i = 0; i < values.size(); ++i) {
    ok = ok && rounded[i] == float_to_bfloat16_bits(values[i]);
  }
  CHECK(ok);
}

void test_prefault_into_fresh_pages(ThreadPool& pool)
{
  // A prefaulting copy into a new mapping: the destination starts 12 bytes into a page and the
  // pieces (grain off any page multiple) end mid-page, so pieces share pages with their
  // neighbours; sentinel bytes written before the copy around the destination, on the pages it
  // partly covers, must survive (prefaulting never zeroes a page that holds data), and a small
  // box and a strided box in the same batch land too.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  constexpr int64_t kCount = (3 << 20) + 5;  // int32 elements, ~12 MiB
  const size_t bytes = 2 * page + kCount * sizeof(int32_t) + 2 * page;
  void* mapping = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(mapping != MAP_FAILED);
  if (mapping == MAP_FAILED) { return; }
  auto* base = static_cast<unsigned char*>(mapping);
  unsigned char* dst = base + page + 12;
  unsigned char* end = dst + kCount * sizeof(int32_t);
  std::memset(base + page, 0xA5, 12);  // the head of the destination's first page
  std::memset(end, 0xA5, 20);          // just past its end, on its last page
  const auto src = iota_vector<int32_t>(kCount, 7);
  const auto small_src = iota_vector<int64_t>(3, 40);
  std::vector<int64_t> small_dst(3, -1);
  const auto strided_src = iota_vector<int16_t>(2 * 500);
  std::vector<int16_t> strided_dst(500, -1);
  BoxCopy batch[3] = {make_box(src.data(), dst, kI32, kI32, {kCount}, {1}, {1}),
                      make_box(small_src.data(), small_dst.data(), kI64, kI64, {3}, {1}, {1}),
                      make_box(strided_src.data(), strided_dst.data(), kI16, kI16, {500}, {2}, {1})};
  box_copy_cpu(batch, 3, pool, (1 << 20) + 12, /*streaming=*/false, /*prefault=*/true);
  CHECK(std::memcmp(dst, src.data(), kCount * sizeof(int32_t)) == 0);
  bool guards = true;
  for (int i = 0; i < 12; ++i) { guards = guards && base[page + i] == 0xA5; }
  for (int i = 0; i < 20; ++i) { guards = guards && end[i] == 0xA5; }
  CHECK(guards);
  CHECK(small_dst == small_src);
  CHECK(box_landed(batch[2]));
  munmap(mapping, bytes);
}

void test_float_formats()
{
  // bf16: round to nearest, ties to even.
  CHECK_EQ_HEX(float_to_bfloat16_bits(1.0f), 0x3F80);
  CHECK_EQ_HEX(float_to_bfloat16_bits(float_of(0x3F808000)), 0x3F80);  // tie, even below
  CHECK_EQ_HEX(float_to_bfloat16_bits(float_of(0x3F818000)), 0x3F82);  // tie, even above
  CHECK_EQ_HEX(float_to_bfloat16_bits(float_of(0x3F808001)), 0x3F81);  // just above the tie
  CHECK_EQ_HEX(float_to_bfloat16_bits(float_of(0x3F807FFF)), 0x3F80);  // just below the tie
  CHECK_EQ_HEX(float_to_bfloat16_bits(-2.5f), 0xC020);
  CHECK_EQ_HEX(float_to_bfloat16_bits(-0.0f), 0x8000);
  CHECK_EQ_HEX(float_to_bfloat16_bits(float_of(0x7F7FFFFF)), 0x7F80);  // FLT_MAX rounds to inf
  CHECK_EQ_HEX(float_to_bfloat16_bits(INFINITY), 0x7F80);
  CHECK_EQ_HEX(float_to_bfloat16_bits(-INFINITY), 0xFF80);
  CHECK_EQ_HEX(float_to_bfloat16_bits(NAN), 0x7FC0);
  CHECK_EQ_HEX(float_to_bfloat16_bits(-NAN), 0x7FC0);
  CHECK_EQ_HEX(float_to_bfloat16_bits(float_of(0x7F800001)), 0x7FC0);  // signalling NaN stays NaN
  CHECK_EQ_HEX(float_to_bfloat16_bits(float_of(0x00018000)), 0x0002);  // subnormal tie, even above
  CHECK_EQ_HEX(float_to_bfloat16_bits(float_of(0x00008000)), 0x0000);  // subnormal tie, even below
  CHECK(bfloat16_bits_to_float(0x3F81) == 1.0078125f);

  // f16: round to nearest even, overflow at 65520, subnormals down to 2^-24.
  CHECK_EQ_HEX(float_to_half_bits(1.0f), 0x3C00);
  CHECK_EQ_HEX(float_to_half_bits(0.1f), 0x2E66);
  CHECK_EQ_HEX(float_to_half_bits(1.0f + 0x1p-11f), 0x3C00);         // tie, even below
  CHECK_EQ_HEX(float_to_half_bits(1.0f + 3 * 0x1p-11f), 0x3C02);     // tie, even above
  CHECK_EQ_HEX(float_to_half_bits(65504.0f), 0x7BFF);
  CHECK_EQ_HEX(float_to_half_bits(65519.99f), 0x7BFF);
  CHECK_EQ_HEX(float_to_half_bits(65520.0f), 0x7C00);
  CHECK_EQ_HEX(float_to_half_bits(-1e9f), 0xFC00);
  CHECK_EQ_HEX(float_to_half_bits(0x1p-14f), 0x0400);                // smallest normal
  CHECK_EQ_HEX(float_to_half_bits(0x1p-24f), 0x0001);                // smallest subnormal
  CHECK_EQ_HEX(float_to_half_bits(0x1p-25f), 0x0000);                // tie to even zero
  CHECK_EQ_HEX(float_to_half_bits(0x1.8p-25f), 0x0001);
  CHECK_EQ_HEX(float_to_half_bits(0x1.ffcp-15f), 0x0400);            // 1023.5 units: up to normal
  CHECK_EQ_HEX(float_to_half_bits(-0.0f), 0x8000);
  CHECK_EQ_HEX(float_to_half_bits(NAN), 0x7E00);
  CHECK_EQ_HEX(float_to_half_bits(-NAN), 0xFE00);
  CHECK(half_bits_to_float(0x3555) == 0.333251953125f);
  CHECK(half_bits_to_float(0x0001) == 0x1p-24f);
  CHECK(half_bits_to_float(0x03FF) == 1023 * 0x1p-24f);
  CHECK(std::isinf(half_bits_to_float(0xFC00)) && half_bits_to_float(0xFC00) < 0);

  // Every finite half and bf16 survives a round trip through float.
  bool round_trips = true;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    if ((h & 0x7C00) != 0x7C00) {
      round_trips = round_trips && float_to_half_bits(half_bits_to_float(bits)) == bits;
    }
    if ((h & 0x7F80) != 0x7F80) {
      round_trips = round_trips && float_to_bfloat16_bits(bfloat16_bits_to_float(bits)) == bits;
    }
  }
  CHECK(round_trips);
}

/// Reads element 0 of a buffer of `kind` as a double (bool/ints/floats), for the matrix test.
double read_as_double(const void* p, int32_t kind)
{
  switch (static_cast<ScalarKind>(kind)) {
    case ScalarKind::kBool: return *static_cast<const uint8_t*>(p);
    case ScalarKind::kUInt8: return *static_cast<const uint8_t*>(p);
    case ScalarKind::kInt8: return *static_cast<const int8_t*>(p);
    case ScalarKind::kInt16: return *static_cast<const int16_t*>(p);
    case ScalarKind::kInt32: return *static_cast<const int32_t*>(p);
    case ScalarKind::kInt64: return static_cast<double>(*static_cast<const int64_t*>(p));
    case ScalarKind::kFloat16: return half_bits_to_float(*static_cast<const uint16_t*>(p));
    case ScalarKind::kBFloat16: return bfloat16_bits_to_float(*static_cast<const uint16_t*>(p));
    case ScalarKind::kFloat32: return *static_cast<const float*>(p);
    case ScalarKind::kFloat64: return *static_cast<const double*>(p);
    default: return NAN;
  }
}

void test_conversion_matrix(ThreadPool& pool)
{
  // Values every real kind holds exactly; for bool only 0 and 1. Each value is first written into
  // the source kind from f64, then converted to every destination kind, inside strided 2-D boxes.
  const std::vector<double> values = {0, 1, 2, 7, 100, 0, 1, 64};
  const auto n = static_cast<int64_t>(values.size());
  for (int32_t from : kRealKinds) {
    for (int32_t to : kRealKinds) {
      alignas(16) unsigned char src[8 * 8 * 2] = {};
      alignas(16) unsigned char dst[8 * 8 * 3] = {};
      std::vector<double> inputs = values;
      if (from == kBool) {
        for (auto& v : inputs) { v = v != 0 ? 1 : 0; }
      }
      // Source: every other slot (stride 2); destination: every third slot.
      BoxCopy fill = make_box(inputs.data(), src, kF64, from, {n}, {1}, {2});
      box_copy_cpu(&fill, 1, pool);
      BoxCopy box = make_box(src, dst, from, to, {2, n / 2}, {n, 2}, {3 * n / 2, 3});
      box_copy_cpu(&box, 1, pool);
      bool ok = true;
      const int32_t dst_size = scalar_kind_size(to);
      for (int64_t i = 0; i < n; ++i) {
        double expected = inputs[i];
        if (to == kBool) { expected = expected != 0 ? 1 : 0; }
        ok = ok && read_as_double(dst + 3 * i * dst_size, to) == expected;
        // The gaps between destination elements are untouched.
        for (int g = 1; g < 3 && 3 * i + g < 3 * n; ++g) {
          for (int32_t b = 0; b < dst_size; ++b) { ok = ok && dst[(3 * i + g) * dst_size + b] == 0; }
        }
      }
      if (!ok) { std::fprintf(stderr, "conversion %d -> %d wrong\n", from, to); }
      CHECK(ok);
    }
  }
}

void test_conversion_rules(ThreadPool& pool)
{
  // Floating -> 16-bit floats, through float as torch does (double rounding included).
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, float_of(0x3F818000), kF32, kBF16), 0x3F82);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, float_of(0x3F808000), kF32, kBF16), 0x3F80);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, NAN, kF32, kBF16), 0x7FC0);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, static_cast<double>(NAN), kF64, kBF16), 0x7FC0);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, 2147483648.0 + 8388608.0 + 1.0, kF64, kBF16), 0x4F00);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, 1.0 + 0x1p-11 + 0x1p-40, kF64, kF16), 0x3C00);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, 65519.0, kF64, kF16), 0x7BFF);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, 1e6f, kF32, kF16), 0x7C00);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, NAN, kF32, kF16), 0x7E00);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, uint16_t{0x3F81}, kBF16, kF16), 0x3C08);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, uint16_t{0x3C01}, kF16, kBF16), 0x3F80);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, uint16_t{0x7C00}, kF16, kBF16), 0x7F80);
  CHECK(convert_one<float>(pool, uint16_t{0x3555}, kF16, kF32) == 0.333251953125f);
  CHECK(convert_one<double>(pool, uint16_t{0xC2F7}, kBF16, kF64) == -123.5);
  CHECK(convert_one<float>(pool, 0.1, kF64, kF32) == 0.1f);
  CHECK(std::isinf(convert_one<float>(pool, 1e39, kF64, kF32)));
  CHECK(convert_one<double>(pool, 0.1f, kF32, kF64) == static_cast<double>(0.1f));

  // Integers -> floating point: nearest, ties to even; 16-bit targets via float.
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, int64_t{2147483648LL + 8388608 + 1}, kI64, kBF16), 0x4F00);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, int32_t{2049}, kI32, kF16), 0x6800);   // 2048
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, int32_t{2051}, kI32, kF16), 0x6802);   // 2052
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, int64_t{65520}, kI64, kF16), 0x7C00);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, uint8_t{255}, kU8, kF16), 0x5BF8);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, int16_t{-257}, kI16, kBF16), 0xC380);   // -256, tie even
  CHECK(convert_one<float>(pool, int64_t{16777217}, kI64, kF32) == 16777216.0f);
  CHECK(convert_one<double>(pool, int8_t{-128}, kI8, kF64) == -128.0);
  CHECK(convert_one<double>(pool, int64_t{-9007199254740993LL}, kI64, kF64) == -9007199254740992.0);

  // Floating -> integers: truncation toward zero.
  CHECK(convert_one<int32_t>(pool, 2.9f, kF32, kI32) == 2);
  CHECK(convert_one<int32_t>(pool, -2.9f, kF32, kI32) == -2);
  CHECK(convert_one<int64_t>(pool, -1.5, kF64, kI64) == -1);
  CHECK(convert_one<int64_t>(pool, 1e18, kF64, kI64) == 1000000000000000000LL);
  CHECK(convert_one<int16_t>(pool, -300.7f, kF32, kI16) == -300);
  CHECK(convert_one<int8_t>(pool, 127.9f, kF32, kI8) == 127);
  CHECK(convert_one<int8_t>(pool, -128.9, kF64, kI8) == -128);
  CHECK(convert_one<uint8_t>(pool, 255.9f, kF32, kU8) == 255);
  CHECK(convert_one<uint8_t>(pool, uint16_t{0x43A0}, kBF16, kU8) == 64);  // 320 wraps through int64
  CHECK(convert_one<int32_t>(pool, uint16_t{0xC2F7}, kBF16, kI32) == -123);
  CHECK(convert_one<int64_t>(pool, uint16_t{0x5BF8}, kF16, kI64) == 255);
  // ... and what torch gives on x86 outside the range (u8 through int64, i8/i16 through int32).
  CHECK(convert_one<uint8_t>(pool, -1.5f, kF32, kU8) == 255);
  CHECK(convert_one<uint8_t>(pool, 300.0f, kF32, kU8) == 44);
  CHECK(convert_one<int8_t>(pool, 300.0f, kF32, kI8) == 44);
  CHECK(convert_one<int16_t>(pool, 1e10f, kF32, kI16) == 0);
  CHECK(convert_one<int32_t>(pool, 1e10f, kF32, kI32) == std::numeric_limits<int32_t>::min());
  CHECK(convert_one<int32_t>(pool, NAN, kF32, kI32) == std::numeric_limits<int32_t>::min());
  CHECK(convert_one<int64_t>(pool, static_cast<double>(NAN), kF64, kI64) ==
        std::numeric_limits<int64_t>::min());
  CHECK(convert_one<int64_t>(pool, 1e19, kF64, kI64) == std::numeric_limits<int64_t>::min());
  CHECK(convert_one<uint8_t>(pool, NAN, kF32, kU8) == 0);

  // Integers -> integers: two's complement wrap.
  CHECK(convert_one<int8_t>(pool, int64_t{300}, kI64, kI8) == 44);
  CHECK(convert_one<int8_t>(pool, int64_t{-129}, kI64, kI8) == 127);
  CHECK(convert_one<uint8_t>(pool, int32_t{-1}, kI32, kU8) == 255);
  CHECK(convert_one<int8_t>(pool, uint8_t{200}, kU8, kI8) == -56);
  CHECK(convert_one<int16_t>(pool, int32_t{70000}, kI32, kI16) == 4464);
  CHECK(convert_one<int64_t>(pool, int16_t{-5}, kI16, kI64) == -5);
  CHECK(convert_one<uint64_t>(pool, int32_t{-1}, kI32, kI64) == ~uint64_t{0});

  // Bool: value != 0 (not a narrowing), NaN is true; any non-zero byte reads as true.
  CHECK(convert_one<uint8_t>(pool, int64_t{256}, kI64, kBool) == 1);
  CHECK(convert_one<uint8_t>(pool, 0.5f, kF32, kBool) == 1);
  CHECK(convert_one<uint8_t>(pool, -0.0f, kF32, kBool) == 0);
  CHECK(convert_one<uint8_t>(pool, NAN, kF32, kBool) == 1);
  CHECK(convert_one<uint8_t>(pool, uint16_t{0x8000}, kBF16, kBool) == 0);  // -0.0
  CHECK(convert_one<uint8_t>(pool, uint16_t{0x0001}, kF16, kBool) == 1);   // smallest subnormal
  CHECK(convert_one<float>(pool, uint8_t{1}, kBool, kF32) == 1.0f);
  CHECK(convert_one<float>(pool, uint8_t{2}, kBool, kF32) == 1.0f);
  CHECK(convert_one<int64_t>(pool, uint8_t{1}, kBool, kI64) == 1);
  CHECK_EQ_HEX(convert_one<uint16_t>(pool, uint8_t{1}, kBool, kBF16), 0x3F80);
  CHECK(convert_one<uint8_t>(pool, uint8_t{7}, kBool, kBool) == 7);  // same kind: a byte copy

  // Complex kinds are copied, never converted.
  const float complex_src[4] = {1.5f, -2.0f, 3.0f, 4.25f};
  float complex_dst[4] = {};
  BoxCopy complex_box = make_box(complex_src, complex_dst, kC64, kC64, {2}, {1}, {1});
  box_copy_cpu(&complex_box, 1, pool);
  CHECK(std::memcmp(complex_src, complex_dst, sizeof(complex_src)) == 0);
  const double complex128_src[4] = {1.5, -2.0, 3.0, 4.25};
  double complex128_dst[2] = {};
  BoxCopy strided_complex = make_box(complex128_src, complex128_dst, kC128, kC128, {1}, {2}, {1});
  box_copy_cpu(&strided_complex, 1, pool);
  CHECK(complex128_dst[0] == 1.5 && complex128_dst[1] == -2.0);
}

}  // namespace

int main()
{
  ThreadPool pool(4);
  test_float_formats();
  test_simplify();
  test_validate();
  test_prefix();
  test_zero_d(pool);
  test_contiguous_1d(pool);
  test_transposed_2d(pool);
  test_3d_with_gaps(pool);
  test_two_kib_rows(pool);
  test_column_halves(pool);
  test_row_groups(pool);
  test_many_small_boxes(pool);
  test_large_split_boxes(pool);
  test_prefault_into_fresh_pages(pool);
  test_conversion_matrix(pool);
  test_conversion_rules(pool);
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
