// A test buffer placed at a chosen offset inside a 4 KiB page, with guard bytes around it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

/// `size` bytes starting `page_offset` bytes into a 4 KiB page, with kGuardBytes of `fill` before
/// and after them inside the same allocation: where the copy tests place sources and
/// destinations, so that rows land at chosen page offsets and a write outside shows in the guards.
struct PagedBuffer {
  static constexpr size_t kGuardBytes = 4096;
  std::vector<unsigned char> storage;
  unsigned char* data;
  size_t size;

  PagedBuffer(size_t size_, size_t page_offset, unsigned char fill)
    : storage(2 * kGuardBytes + 4096 + size_, fill), size(size_)
  {
    const auto base = reinterpret_cast<std::uintptr_t>(storage.data() + kGuardBytes);
    const size_t to_page = (4096 - base % 4096) % 4096;
    data = storage.data() + kGuardBytes + to_page + page_offset % 4096;
  }

  /// Whether every guard byte still holds `fill`.
  bool guards_intact(unsigned char fill) const
  {
    for (const unsigned char* p = storage.data(); p < data; ++p) {
      if (*p != fill) { return false; }
    }
    for (const unsigned char* p = data + size; p < storage.data() + storage.size(); ++p) {
      if (*p != fill) { return false; }
    }
    return true;
  }
};
