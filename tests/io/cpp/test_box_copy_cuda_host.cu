// The CUDA box copy's per-thread code (csrc/cuda/box_copy_cuda.cu) run on the CPU, compared with
// the CPU box copy (csrc/box_copy.cpp) on the same descriptors. No GPU is needed: nvcc compiles
// the __host__ __device__ functions for the host too. From the repository root:
//   nvcc -std=c++17 -O2 -I csrc tests/io/cpp/test_box_copy_cuda_host.cu csrc/box_copy.cpp
//        csrc/prefault.cpp csrc/stream_copy.cpp csrc/thread_pool.cpp -o test_box_copy_cuda_host
// It prints "N passed, M failed" and exits non-zero when anything failed.
//
// run_kernel_on_host walks the chunks and boxes exactly as box_copy_kernel does, with the blocks
// one after another and the threads of a block one after another. That gives the kernel's result:
// copy_box_range has no block synchronisation inside, and no two threads write the same byte.
#include "cuda/box_copy_cuda.cu"

#include "box_copy.hpp"
#include "thread_pool.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace fastdcp;

namespace {

int g_passed = 0;
int g_failed = 0;

void check(bool ok, const std::string& what)
{
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

constexpr auto kRaw = static_cast<int32_t>(ScalarKind::kRawBytes);
constexpr auto kU8 = static_cast<int32_t>(ScalarKind::kUInt8);
constexpr auto kF32 = static_cast<int32_t>(ScalarKind::kFloat32);
constexpr auto kBF16 = static_cast<int32_t>(ScalarKind::kBFloat16);

BoxCopy make_box(const void* src, void* dst, int32_t src_kind, int32_t dst_kind, int32_t src_elem,
                 int32_t dst_elem, std::vector<int64_t> shape, std::vector<int64_t> src_stride,
                 std::vector<int64_t> dst_stride)
{
  BoxCopy box{};
  box.src = src;
  box.dst = dst;
  box.ndim = static_cast<int32_t>(shape.size());
  box.src_kind = src_kind;
  box.dst_kind = dst_kind;
  box.src_elem_size = src_elem;
  box.dst_elem_size = dst_elem;
  for (size_t d = 0; d < shape.size(); ++d) {
    box.shape[d] = shape[d];
    box.src_stride[d] = src_stride[d];
    box.dst_stride[d] = dst_stride[d];
  }
  return box;
}

/// Mirrors box_copy_kernel<kConvert> on the host with `grid` blocks of kThreads threads and chunks
/// of `chunk` elements.
template <bool kConvert>
void run_kernel_on_host(const std::vector<BoxCopy>& boxes, int64_t grid, int64_t chunk)
{
  const auto num_boxes = static_cast<int64_t>(boxes.size());
  std::vector<int64_t> prefix(boxes.size() + 1);
  const int64_t total = box_element_prefix(boxes.data(), boxes.size(), prefix.data());
  for (int64_t block = 0; block < grid; ++block) {
    for (int64_t chunk_begin = block * chunk; chunk_begin < total; chunk_begin += grid * chunk) {
      const int64_t chunk_end = std::min(total, chunk_begin + chunk);
      for (int64_t b = find_box(prefix.data(), num_boxes, chunk_begin); b < num_boxes; ++b) {
        const int64_t box_begin = prefix[b];
        if (box_begin >= chunk_end) { break; }
        const int64_t box_end = prefix[b + 1];
        if (box_end == box_begin) { continue; }
        for (int thread = 0; thread < kThreads; ++thread) {
          copy_box_range<kConvert>(boxes[b], std::max(chunk_begin, box_begin) - box_begin,
                                   std::min(chunk_end, box_end) - box_begin, thread);
        }
      }
    }
  }
}

/// Bytes for the sources and destinations of a batch: `size` bytes at `misalignment` bytes past a
/// 256-byte boundary, inside an allocation with spare bytes on both sides.
struct Buffer {
  std::vector<unsigned char> storage;
  unsigned char* data;

  size_t size;

  Buffer(size_t size_, size_t misalignment) : storage(size_ + 1024), size(size_)
  {
    const auto base = reinterpret_cast<uintptr_t>(storage.data() + 256);
    data = storage.data() + 256 + (256 - base % 256) % 256 + misalignment;
  }

  /// The bytes from 128 before `data` to 128 past its end: the destination and guard bytes.
  std::vector<unsigned char> window() const
  {
    return std::vector<unsigned char>(data - 128, data + size + 128);
  }
};

/// One batch of boxes over one source buffer and a destination buffer: `make(src, dst)` builds
/// the descriptors for given base pointers, so the same batch can be pointed at two destinations.
struct Batch {
  std::string name;
  size_t src_bytes;
  size_t dst_bytes;
  size_t src_misalignment;
  size_t dst_misalignment;
  std::vector<BoxCopy> (*make)(const unsigned char* src, unsigned char* dst);
};

/// Runs `batch` through box_copy_cpu and through the emulated kernel (the converting build, and
/// the byte-copy-only build when no box converts), with the descriptors as given and simplified,
/// at several chunk sizes and grids, and checks that every destination byte (those outside the
/// boxes included) agrees.
void check_batch(ThreadPool& pool, const Batch& batch)
{
  Buffer src(batch.src_bytes, batch.src_misalignment);
  for (size_t i = 0; i < src.storage.size(); ++i) {
    // Bytes of f32 values in [1, 2) with every mantissa pattern: finite, so that a converting box
    // rounds the same way on both sides, and odd bytes for everything else.
    src.storage[i] = (i % 4 == 3) ? 0x3F : static_cast<unsigned char>(i * 167 + (i >> 8) + 3);
  }
  Buffer expected(batch.dst_bytes, batch.dst_misalignment);
  std::fill(expected.storage.begin(), expected.storage.end(), 0xCD);
  const std::vector<BoxCopy> cpu_boxes = batch.make(src.data, expected.data);
  box_copy_cpu(cpu_boxes.data(), cpu_boxes.size(), pool, 4096);

  bool any_conversion = false;
  for (const BoxCopy& box : cpu_boxes) {
    any_conversion = any_conversion || !box_is_byte_copy(box);
  }
  const int64_t chunks[] = {1024, 777, 4096, 64 * 1024};
  const int64_t grids[] = {1, 7};
  for (bool simplified : {false, true}) {
    for (int64_t chunk : chunks) {
      for (int64_t grid : grids) {
        for (bool convert_build : {true, false}) {
          if (!convert_build && any_conversion) { continue; }
          Buffer actual(batch.dst_bytes, batch.dst_misalignment);
          std::fill(actual.storage.begin(), actual.storage.end(), 0xCD);
          std::vector<BoxCopy> boxes = batch.make(src.data, actual.data);
          for (BoxCopy& box : boxes) {
            validate_box(box);
            if (simplified) { simplify_box(box); }
          }
          if (convert_build) {
            run_kernel_on_host<true>(boxes, grid, chunk);
          } else {
            run_kernel_on_host<false>(boxes, grid, chunk);
          }
          const bool same = actual.window() == expected.window();
          check(same, batch.name + (simplified ? ", simplified" : ", as given") + ", chunk " +
                        std::to_string(chunk) + ", grid " + std::to_string(grid) +
                        (convert_build ? ", converting build" : ", byte-copy build"));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Batches
// ---------------------------------------------------------------------------------------------

/// The two column halves of a rows x (2 * half) matrix from a contiguous source (left half, then
/// right half), behind a 1-D box of 37 elements that puts the halves at odd element offsets of the
/// batch, so that chunk boundaries cut rows.
std::vector<BoxCopy> column_halves(const unsigned char* src, unsigned char* dst, int32_t kind,
                                   int32_t elem, int64_t rows, int64_t half)
{
  std::vector<BoxCopy> boxes;
  const int64_t matrix = rows * 2 * half * elem;
  boxes.push_back(make_box(src + matrix, dst + matrix, kind, kind, elem, elem, {37}, {1}, {1}));
  for (int h = 0; h < 2; ++h) {
    boxes.push_back(make_box(src + h * rows * half * elem, dst + h * half * elem, kind, kind, elem,
                             elem, {rows, half}, {half, 1}, {2 * half, 1}));
  }
  return boxes;
}

size_t column_halves_src_bytes(int64_t rows, int64_t half, int32_t elem)
{
  return static_cast<size_t>((rows * 2 * half + 37) * elem);
}

/// Rows of `cols` elements, `src_pitch` and `dst_pitch` elements apart: the word path with a byte
/// tail where the row is not a whole number of words.
std::vector<BoxCopy> padded_rows(const unsigned char* src, unsigned char* dst, int32_t kind,
                                 int32_t elem, int64_t rows, int64_t cols, int64_t src_pitch,
                                 int64_t dst_pitch)
{
  return {make_box(src, dst, kind, kind, elem, elem, {rows, cols}, {src_pitch, 1}, {dst_pitch, 1})};
}

const Batch kBatches[] = {
  // 16-byte words, 2 KiB rows, many rows (bf16 halves of a 4 KiB-wide matrix).
  {"bf16 column halves, 2 KiB rows", column_halves_src_bytes(300, 1024, 2), 300 * 2048 * 2 + 37 * 2,
   0, 0, [](const unsigned char* s, unsigned char* d) { return column_halves(s, d, kBF16, 2, 300, 1024); }},
  // 576-byte rows: 36 words, which does not divide the block's 256 threads.
  {"bf16 column halves, 576-byte rows", column_halves_src_bytes(700, 288, 2), 700 * 576 * 2 + 37 * 2,
   0, 0, [](const unsigned char* s, unsigned char* d) { return column_halves(s, d, kBF16, 2, 700, 288); }},
  // 16-byte words and a 6-byte tail per row (1003 bf16 in rows 2 KiB / 4 KiB apart).
  {"rows with a byte tail", 2048 * 400, 4096 * 400, 0, 0,
   [](const unsigned char* s, unsigned char* d) { return padded_rows(s, d, kBF16, 2, 400, 1003, 1024, 2048); }},
  // 8-byte words: the source 8 bytes past a 16-byte boundary.
  {"8-byte words", 2048 * 300, 4096 * 300, 8, 0,
   [](const unsigned char* s, unsigned char* d) { return padded_rows(s, d, kF32, 4, 300, 500, 512, 1024); }},
  // 4-byte words: 37 f32 per row, contiguous source (pitch 148 bytes).
  {"f32 column halves of 37", column_halves_src_bytes(900, 37, 4), 900 * 74 * 4 + 37 * 4, 0, 4,
   [](const unsigned char* s, unsigned char* d) { return column_halves(s, d, kF32, 4, 900, 37); }},
  // 2-byte words: 1001 bf16 per half row (pitch 2002 bytes).
  {"bf16 column halves of 1001", column_halves_src_bytes(200, 1001, 2), 200 * 2002 * 2 + 37 * 2, 0, 2,
   [](const unsigned char* s, unsigned char* d) { return column_halves(s, d, kBF16, 2, 200, 1001); }},
  // 1-byte words: u8 rows of 257, the destination at an odd address.
  {"u8 column halves of 257", column_halves_src_bytes(500, 257, 1), 500 * 514 + 37, 0, 1,
   [](const unsigned char* s, unsigned char* d) { return column_halves(s, d, kU8, 1, 500, 257); }},
  // 16-byte elements (complex128 travels as raw bytes), 3 per half row.
  {"16-byte elements", column_halves_src_bytes(1000, 3, 16), 1000 * 6 * 16 + 37 * 16, 0, 0,
   [](const unsigned char* s, unsigned char* d) { return column_halves(s, d, kRaw, 16, 1000, 3); }},
  // One word per row: 256 rows per step of the block.
  {"16-byte rows", 16 * 5000, 32 * 5000, 0, 0,
   [](const unsigned char* s, unsigned char* d) { return padded_rows(s, d, kF32, 4, 5000, 4, 4, 8); }},
  // 257 words per row: more than a block's threads, a step stays in its row or wraps into the next.
  {"257-word rows", 4112 * 60, 8224 * 60, 0, 0,
   [](const unsigned char* s, unsigned char* d) { return padded_rows(s, d, kRaw, 16, 60, 257, 257, 514); }},
  // Rows longer than the largest chunk: only partial rows, never a whole one.
  {"rows longer than a chunk", 2 * 5 * 70000, 2 * 5 * 70001, 0, 0,
   [](const unsigned char* s, unsigned char* d) { return padded_rows(s, d, kBF16, 2, 5, 70000, 70000, 70001); }},
  // A source row read for every destination row (source pitch 0).
  {"broadcast source row", 2 * 600, 2 * 600 * 300, 0, 0,
   [](const unsigned char* s, unsigned char* d) { return padded_rows(s, d, kBF16, 2, 300, 600, 0, 600); }},
  // The generic paths next to the row path: a converting column half (f32 into bf16), a 3-D
  // same-kind box with contiguous rows and a converting 3-D box (a division for the middle
  // dimension), a transposed 2-D box (strided rows), a contiguous 1-D box.
  {"mixed batch", 4 * 400 * 300 + 4 * 5 * 7 * 300 + 2 * 64 * 48 + 4096, 2 * 400 * 600 + 4 * 5 * 7 * 301 * 2 + 2 * 64 * 48 + 4096, 0, 0,
   [](const unsigned char* s, unsigned char* d) {
     std::vector<BoxCopy> boxes;
     boxes.push_back(make_box(s, d + 600, kF32, kBF16, 4, 2, {400, 300}, {300, 1}, {600, 1}));
     const unsigned char* s3 = s + 4 * 400 * 300;
     unsigned char* d3 = d + 2 * 400 * 600;
     boxes.push_back(make_box(s3, d3, kF32, kF32, 4, 4, {5, 7, 300}, {2100, 300, 1}, {7 * 301, 301, 1}));
     boxes.push_back(make_box(s3, d3 + 4 * 5 * 7 * 301, kF32, kBF16, 4, 2, {5, 7, 300}, {2100, 300, 1},
                              {7 * 301 * 2, 301 * 2, 2}));
     const unsigned char* st = s3 + 4 * 5 * 7 * 300;
     unsigned char* dt = d3 + 4 * 5 * 7 * 301 * 2;
     boxes.push_back(make_box(st, dt, kBF16, kBF16, 2, 2, {64, 48}, {1, 64}, {48, 1}));
     boxes.push_back(make_box(st + 2 * 64 * 48, dt + 2 * 64 * 48, kU8, kU8, 1, 1, {4000}, {1}, {1}));
     return boxes;
   }},
};

// ---------------------------------------------------------------------------------------------
// The counters and the fallback on their own
// ---------------------------------------------------------------------------------------------

void test_row_cursor()
{
  bool ok = true;
  std::vector<uint32_t> lengths;
  for (uint32_t n = 1; n <= 600; ++n) {
    lengths.push_back(n);
  }
  for (uint32_t n : {1023u, 4096u, 70000u, 1u << 20}) {
    lengths.push_back(n);
  }
  for (uint32_t row_units : lengths) {
    for (uint32_t start : {0u, 1u, 100u, 255u}) {
      RowCursor cursor(start, row_units);
      for (uint32_t step = 0; step < 300 && ok; ++step) {
        const uint32_t index = start + step * kThreads;
        ok = cursor.row == index / row_units && cursor.unit == index % row_units;
        cursor.advance();
      }
    }
  }
  check(ok, "RowCursor agrees with division");
}

void test_rows_one_by_one()
{
  // The fallback of copy_rows_as for walks beyond kMaxFlatUnits (too large to allocate here).
  std::vector<unsigned char> src(37 * 100);
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = static_cast<unsigned char>(i * 29 + 1);
  }
  std::vector<unsigned char> dst(50 * 100, 0);
  for (int thread = 0; thread < kThreads; ++thread) {
    copy_rows_one_by_one(reinterpret_cast<const char*>(src.data()), 37,
                         reinterpret_cast<char*>(dst.data()), 50, 100, 37, thread);
  }
  bool ok = true;
  for (int r = 0; r < 100; ++r) {
    ok = ok && std::memcmp(dst.data() + r * 50, src.data() + r * 37, 37) == 0;
    for (int b = 37; b < 50; ++b) {
      ok = ok && dst[r * 50 + b] == 0;
    }
  }
  check(ok, "copy_rows_one_by_one");
}

}  // namespace

int main()
{
  ThreadPool pool(2);
  test_row_cursor();
  test_rows_one_by_one();
  for (const Batch& batch : kBatches) {
    check_batch(pool, batch);
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
