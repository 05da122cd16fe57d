// Faulting in fresh destination pages ahead of a copy, in one system call per range.
//
// The first async_save of a process copies the state into a new staging slab, and every 4 KiB
// page of it is faulted in by the copy's first store: one trap into the kernel per page. Asking
// the kernel to populate a whole piece first (MADV_POPULATE_WRITE, Linux 5.14) does the same work
// without the traps. Measured on a 2-core VM (Intel host), 1 GiB copied by the
// engine's box copy on 2 threads into a new private mapping: 0.19-0.20 s with each 1 MiB piece
// populated first against 0.26 s page by page (torch's copy_: 0.22 s) when the kernel had the
// memory at hand; 0.35-0.42 s against 0.43 s for the first such mapping of a process, where the
// hypervisor's cost of handing the guest new memory dominates either way.
#pragma once

#include <cstddef>

namespace fastdcp {

/// Asks the kernel to fault in, writable, every page that lies wholly inside `[dst, dst + n)`,
/// as a store to each would, without changing any byte: pages already there are left as they are,
/// so it is safe while other threads write other pages of the same mapping. Pages the range only
/// partly covers are left to the caller's stores (another caller may own the rest of them).
///
/// Returns true when the kernel populated the range. Returns false, changing no byte, when it
/// did not (or not wholly): a kernel without MADV_POPULATE_WRITE (Linux before 5.14, probed once
/// per process), a non-Linux build, a range with no whole page, or a range the kernel refuses to
/// populate (not writable, not mapped, device memory, out of memory). The caller's stores then
/// fault the pages in as they would have anyway, and meet any real error themselves.
bool prefault_writable(void* dst, size_t n);

}  // namespace fastdcp
