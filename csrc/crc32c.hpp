// CRC-32C (Castagnoli), the checksum fastdcp records per tensor blob when asked to.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastdcp {

/// CRC-32C of `nbytes` bytes at `data`, continuing from `crc` (0 for a fresh checksum; the usual
/// pre/post inversion is applied inside, so crc32c(b, crc32c(a)) == crc32c(a + b)).
/// Uses the SSE4.2 crc32 instruction, three streams interleaved, when the CPU has it (checked once
/// at run time); a table-driven fallback otherwise. Thread-safe.
uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc = 0);

/// True when the hardware path is in use on this CPU.
bool crc32c_hardware();

}  // namespace fastdcp
