// The pybind11 boundary of fastdcp._C: the only translation unit that includes Python headers.
// It carries ints (addresses, offsets, sizes), bytes-like objects and file handles; the Python
// caller keeps every tensor it passes an address of alive for the duration of the call. Every
// blocking call releases the GIL. C++ never calls back into Python.
//
// No torch header is needed here (tensors cross as addresses), which keeps this unit compiling in
// seconds instead of the ~2 minutes <torch/extension.h> costs; should one ever be needed, it goes
// in this file only.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "box_copy.hpp"
#include "crc32c.hpp"
#include "engine.hpp"
#include "file.hpp"
#include "io_error.hpp"
#include "radix_sort.hpp"

#ifdef FASTDCP_WITH_CUDA
#include "cuda/box_copy_cuda.cuh"
#include "cuda/memcpy_batch.cuh"
#endif

#include <fcntl.h>

#include <cstddef>
#include <cstring>
#include <memory>
#include <tuple>
#include <utility>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;
using fastdcp::Engine;
using fastdcp::File;

namespace {

std::byte* address(uint64_t value) { return reinterpret_cast<std::byte*>(static_cast<uintptr_t>(value)); }

/// Byte source/destination given by Python: an int address with an explicit size, or an object
/// with the buffer protocol (bytes for writes, bytearray/memoryview for reads).
struct PyBytesView {
  std::byte* data = nullptr;
  size_t size = 0;
};

PyBytesView view_of(const py::handle& obj, const py::handle& size, bool writable,
                    std::vector<py::buffer_info>& keep)
{
  if (py::isinstance<py::int_>(obj)) {
    if (size.is_none()) { throw py::value_error("an address needs an explicit byte size"); }
    return {address(obj.cast<uint64_t>()), size.cast<size_t>()};
  }
  auto buffer = py::reinterpret_borrow<py::buffer>(obj);
  keep.push_back(buffer.request(writable));
  const auto& info = keep.back();
  size_t nbytes = static_cast<size_t>(info.size * info.itemsize);
  if (!size.is_none()) {
    nbytes = size.cast<size_t>();
    if (nbytes > static_cast<size_t>(info.size * info.itemsize)) { throw py::value_error("size exceeds buffer"); }
  }
  return {static_cast<std::byte*>(info.ptr), nbytes};
}

py::dict build_info()
{
  py::dict info;
#ifdef FASTDCP_WITH_CUDA
  info["cuda"] = true;
  info["cuda_arch_list"] = FASTDCP_CUDA_ARCH_LIST;
#else
  info["cuda"] = false;
  info["cuda_arch_list"] = py::none();
#endif
#ifdef O_DIRECT
  info["o_direct"] = true;
#else
  info["o_direct"] = false;
#endif
  info["io_uring"] = false;
  info["crc32c_hardware"] = fastdcp::crc32c_hardware();
  info["direct_align"] = fastdcp::kDirectAlign;
  info["torch_compiled"] = FASTDCP_TORCH_VERSION;
  info["compiler"] = __VERSION__;
  return info;
}

/// Validates and simplifies `num_boxes` packed BoxCopy descriptors in place (host memory at
/// `table`) and writes their element prefix (num_boxes + 1 int64 at `prefix`); returns the total.
/// This is the host half of a GPU box copy: the table and prefix are then uploaded as they are.
int64_t prepare_boxes(uint64_t table, int64_t num_boxes, uint64_t prefix)
{
  if (num_boxes < 0) { throw py::value_error("negative box count"); }
  if (table % alignof(fastdcp::BoxCopy) != 0 || prefix % alignof(int64_t) != 0) {
    throw py::value_error("box table and prefix must be 8-byte aligned");
  }
  if (num_boxes > 0 && table == 0) { throw py::value_error("null box table"); }
  if (prefix == 0) { throw py::value_error("null prefix"); }
  auto* boxes = reinterpret_cast<fastdcp::BoxCopy*>(address(table));
  for (int64_t i = 0; i < num_boxes; ++i) {
    try {
      fastdcp::validate_box(boxes[i]);
    } catch (const std::invalid_argument& e) {
      throw py::value_error("box " + std::to_string(i) + ": " + e.what());
    }
    fastdcp::simplify_box(boxes[i]);
  }
  return fastdcp::box_element_prefix(boxes, static_cast<size_t>(num_boxes),
                                     reinterpret_cast<int64_t*>(address(prefix)));
}

/// A contiguous read-only view of a Python object's bytes, held (and the export released) for the
/// view's lifetime: while it is held, an exporter such as mmap or bytearray refuses to close or resize.
class ContiguousBytes {
 public:
  /// Precondition: the GIL is held. Throws py::error_already_set (BufferError, TypeError) when `obj`
  /// has no buffer protocol or its buffer is not C-contiguous (a strided numpy view, say).
  explicit ContiguousBytes(const py::handle& obj)
  {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_SIMPLE) != 0) { throw py::error_already_set(); }
  }
  ContiguousBytes(const ContiguousBytes&)            = delete;
  ContiguousBytes& operator=(const ContiguousBytes&) = delete;
  ~ContiguousBytes() { PyBuffer_Release(&view_); }  // destroyed with the GIL held

  [[nodiscard]] const void* data() const noexcept { return view_.buf; }
  [[nodiscard]] size_t size() const noexcept { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_{};
};

/// CRC-32C (Castagnoli) of every byte of `data`, continuing `seed` (the CRC of the bytes before
/// it: crc32c(b, crc32c(a)) == crc32c(a + b); an empty buffer returns `seed`).
/// Preconditions: `data` exports a C-contiguous buffer (bytes, bytearray, memoryview, mmap, a
/// contiguous numpy array); `seed` fits 32 bits. Runs on the calling thread with the GIL released,
/// on the SSE4.2 path where the CPU has it, else on the table-driven fallback (csrc/crc32c.hpp).
uint32_t crc32c_of_buffer(const py::handle& data, uint32_t seed)
{
  ContiguousBytes bytes(data);
  py::gil_scoped_release release;
  return fastdcp::crc32c(bytes.data(), bytes.size(), seed);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
  m.doc() = "fastdcp native I/O engine";

  static py::exception<fastdcp::IoError> unused(m, "_NativeIoError");  // never raised; see translator
  (void)unused;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) { std::rethrow_exception(p); }
    } catch (const fastdcp::IoError& e) {
      if (e.errno_value() == 0) {
        PyErr_SetString(PyExc_EOFError, e.what());
      } else {
        // OSError(errno, message, filename): keeps errno for callers and names the file.
        py::object err = py::module_::import("builtins").attr("OSError")(e.errno_value(), e.what(), e.path());
        PyErr_SetObject(PyExc_OSError, err.ptr());
      }
    }
  });

  m.def("build_info", &build_info, "What the extension was compiled with.");
  m.def("crc32c", &crc32c_of_buffer, py::arg("data"), py::arg("seed") = 0,
        "CRC-32C of a C-contiguous buffer (bytes, bytearray, memoryview, mmap, numpy), continuing "
        "seed (the CRC of the bytes before it), computed with the GIL released.");
  m.def("box_copy_size", [] { return sizeof(fastdcp::BoxCopy); },
        "sizeof(BoxCopy): the packed descriptor size prepare_boxes and launch_box_copy expect.");
  m.def(
    "box_copy_layout",
    [] {
      using fastdcp::BoxCopy;
      using fastdcp::ScalarKind;
      py::dict offsets;
      offsets["src"] = offsetof(BoxCopy, src);
      offsets["dst"] = offsetof(BoxCopy, dst);
      offsets["ndim"] = offsetof(BoxCopy, ndim);
      offsets["src_kind"] = offsetof(BoxCopy, src_kind);
      offsets["dst_kind"] = offsetof(BoxCopy, dst_kind);
      offsets["src_elem_size"] = offsetof(BoxCopy, src_elem_size);
      offsets["dst_elem_size"] = offsetof(BoxCopy, dst_elem_size);
      offsets["shape"] = offsetof(BoxCopy, shape);
      offsets["src_stride"] = offsetof(BoxCopy, src_stride);
      offsets["dst_stride"] = offsetof(BoxCopy, dst_stride);
      py::dict kinds;
      const std::pair<const char*, ScalarKind> named[] = {
        {"raw", ScalarKind::kRawBytes}, {"uint8", ScalarKind::kUInt8},         {"int8", ScalarKind::kInt8},
        {"int16", ScalarKind::kInt16},  {"int32", ScalarKind::kInt32},         {"int64", ScalarKind::kInt64},
        {"float16", ScalarKind::kFloat16}, {"float32", ScalarKind::kFloat32},  {"float64", ScalarKind::kFloat64},
        {"complex64", ScalarKind::kComplex64}, {"complex128", ScalarKind::kComplex128},
        {"bool", ScalarKind::kBool},    {"bfloat16", ScalarKind::kBFloat16}};
      for (const auto& [name, kind] : named) { kinds[name] = static_cast<int32_t>(kind); }
      py::dict layout;
      layout["size"] = sizeof(BoxCopy);
      layout["align"] = alignof(BoxCopy);
      layout["max_dims"] = fastdcp::kMaxBoxDims;
      layout["offsets"] = offsets;
      layout["kinds"] = kinds;
      return layout;
    },
    "struct BoxCopy as compiled: size, alignment, max_dims, each field's byte offset and the "
    "ScalarKind numbers by dtype name (what fastdcp.io.boxes packs must match).");
  m.def("prepare_boxes", &prepare_boxes, py::arg("table_address"), py::arg("num_boxes"),
        py::arg("prefix_address"),
        "Validate and simplify packed BoxCopy descriptors in place (host memory) and write their "
        "int64 element prefix (num_boxes + 1 entries); returns the total element count. "
        "Raises ValueError naming the first invalid box.");
#ifdef FASTDCP_WITH_CUDA
  m.def(
    "launch_box_copy",
    [](uint64_t d_boxes, uint64_t d_prefix, int64_t num_boxes, int64_t total_elems, uint64_t stream,
       bool any_conversion) {
      if (num_boxes < 0 || total_elems < 0) { throw py::value_error("negative box or element count"); }
      if (num_boxes > 0 && (d_boxes == 0 || d_prefix == 0)) { throw py::value_error("null device box table or prefix"); }
      cudaError_t status = cudaSuccess;
      {
        py::gil_scoped_release release;
        status = fastdcp::launch_box_copy(reinterpret_cast<const fastdcp::BoxCopy*>(address(d_boxes)),
                                          reinterpret_cast<const int64_t*>(address(d_prefix)),
                                          static_cast<size_t>(num_boxes), total_elems,
                                          reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream)),
                                          any_conversion);
      }
      if (status != cudaSuccess) {
        throw std::runtime_error(std::string("fastdcp box copy kernel launch failed: ") +
                                 cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
      }
    },
    py::arg("d_boxes_address"), py::arg("d_prefix_address"), py::arg("num_boxes"), py::arg("total_elems"),
    py::arg("stream_address"), py::arg("any_conversion") = true,
    "Enqueue one kernel copying num_boxes prepared BoxCopy descriptors (device memory, see "
    "prepare_boxes) on the given cudaStream_t (torch.cuda.Stream.cuda_stream). any_conversion=False "
    "(no box changes dtype) runs the byte-copy-only kernel; a converting box is then not copied. "
    "Does not synchronise; raises RuntimeError naming the CUDA error if the launch fails.");
  m.def(
    "memcpy_batch_async",
    [](uint64_t table, int64_t count, uint64_t stream) {
      if (count < 0) { throw py::value_error("negative job count"); }
      if (count > 0 && table == 0) { throw py::value_error("null job table"); }
      cudaError_t status = cudaSuccess;
      size_t failed = 0;
      {
        py::gil_scoped_release release;
        status = fastdcp::memcpy_batch_async(reinterpret_cast<const fastdcp::MemcpyJob*>(address(table)),
                                             static_cast<size_t>(count),
                                             reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream)), &failed);
      }
      if (status != cudaSuccess) {
        throw std::runtime_error("fastdcp batched copy " + std::to_string(failed) + " of " + std::to_string(count) +
                                 " failed to enqueue: " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
      }
    },
    py::arg("table_address"), py::arg("count"), py::arg("stream_address"),
    "Enqueue `count` copies on a cudaStream_t (torch.cuda.Stream.cuda_stream), in order, in one call: the "
    "table is `count` triples of int64 {dst, src, nbytes} in host memory (read during the call only). "
    "Does not synchronise; raises RuntimeError naming the first job that failed to enqueue.");
#endif
  m.def(
    "memory_view",
    [](uint64_t source, size_t nbytes) {
      if (source == 0 && nbytes > 0) { throw py::value_error("null address with a non-zero size"); }
      return py::memoryview::from_memory(static_cast<const void*>(address(source)), static_cast<py::ssize_t>(nbytes));
    },
    py::arg("address"), py::arg("nbytes"),
    "A read-only memoryview of nbytes at address (format 'B'), for handing host memory to a client "
    "library that takes the buffer protocol. Precondition: the caller keeps the memory alive and "
    "unchanged while the view is in use.");
  m.def(
    "scatter",
    [](const py::buffer& source, const std::vector<std::tuple<size_t, uint64_t, size_t>>& runs) {
      py::buffer_info info = source.request(false);
      const auto* base = static_cast<const std::byte*>(info.ptr);
      const size_t size = static_cast<size_t>(info.size * info.itemsize);
      for (const auto& [offset, dest, nbytes] : runs) {
        if (offset > size || nbytes > size - offset) {
          throw py::value_error("scatter run [" + std::to_string(offset) + ", +" + std::to_string(nbytes) +
                                ") exceeds the " + std::to_string(size) + "-byte source");
        }
        if (dest == 0 && nbytes > 0) { throw py::value_error("scatter to a null address"); }
      }
      py::gil_scoped_release release;
      for (const auto& [offset, dest, nbytes] : runs) { std::memcpy(address(dest), base + offset, nbytes); }
    },
    py::arg("source"), py::arg("runs"),
    "Copy byte runs of a (read-only) buffer to host addresses: runs are (source_offset, dest_address, "
    "nbytes). Every run is checked against the source before anything is copied; the copy releases "
    "the GIL. Precondition: each destination holds nbytes and stays alive for the call.");
  m.def(
    "stable_argsort_u64",
    [](uint64_t keys_address, size_t n, uint64_t order_address) {
      if (n > 0 && (keys_address == 0 || order_address == 0)) { throw py::value_error("null address with n > 0"); }
      py::gil_scoped_release release;
      return fastdcp::stable_argsort_u64(reinterpret_cast<const uint64_t*>(address(keys_address)), n,
                                         reinterpret_cast<int64_t*>(address(order_address)));
    },
    py::arg("keys_address"), py::arg("n"), py::arg("order_address"),
    "Write to order_address (n int64s) the stable ascending order of the n unsigned 64-bit keys at "
    "keys_address (torch.argsort(keys, stable=True) for non-negative keys) by a linear-time radix "
    "sort, and return True; return False, writing nothing, when the largest key and n - 1 need more "
    "than 64 bits together. Releases the GIL. Preconditions: both addresses hold n values, do not "
    "overlap and stay alive for the call.");
  m.def("on_memory_filesystem", &fastdcp::on_memory_filesystem, py::arg("path"),
        "True when path is on tmpfs/ramfs (O_DIRECT pointless there).");
  m.def("page_cache_resident_fraction", &fastdcp::page_cache_resident_fraction, py::arg("path"),
        py::arg("max_pages") = fastdcp::kResidencyPages, py::call_guard<py::gil_scoped_release>(),
        "Fraction of path's pages in the page cache (mincore on a mapping; no page touched; at most "
        "max_pages pages checked, in windows spread over the file): 1.0 for an empty file, -1.0 when "
        "unknown; OSError (FileNotFoundError) when path cannot be stat'ed or opened.");

  py::class_<File, std::shared_ptr<File>>(m, "File")
    .def(py::init([](const std::string& path, const std::string& mode, bool direct) {
           if (mode != "r" && mode != "w") { throw py::value_error("mode must be 'r' or 'w'"); }
           py::gil_scoped_release release;
           return std::make_shared<File>(path, mode == "r" ? fastdcp::OpenMode::kRead : fastdcp::OpenMode::kWriteTruncate, direct);
         }),
         py::arg("path"), py::arg("mode"), py::arg("direct"),
         "Open a file ('r' or 'w' = create/truncate); direct=True tries O_DIRECT with buffered fallback.")
    .def("reopen", &File::reopen, py::arg("direct"), py::call_guard<py::gil_scoped_release>(),
         "The same open file (same inode, even if its path was unlinked or replaced) opened again "
         "for reading; direct=True tries O_DIRECT with buffered fallback.")
    .def_property_readonly("path", &File::path)
    .def_property_readonly("direct", &File::direct)
    .def_property_readonly("closed", [](const File& f) { return !f.is_open(); })
    .def("size", &File::size, py::call_guard<py::gil_scoped_release>())
    .def("truncate", &File::truncate, py::arg("size"), py::call_guard<py::gil_scoped_release>())
    .def("allocate", &File::allocate, py::arg("size"), py::call_guard<py::gil_scoped_release>())
    .def("sync", &File::sync, py::arg("data_only") = false, py::call_guard<py::gil_scoped_release>())
    .def("close", &File::close, py::call_guard<py::gil_scoped_release>());

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
    .def(py::init<int, size_t>(), py::arg("num_threads"), py::arg("task_bytes"))
    .def_property_readonly("num_threads", &Engine::num_threads)
    .def_property_readonly("task_bytes", &Engine::task_bytes)
    .def(
      "write",
      [](Engine& engine, const py::list& jobs) {
        // jobs: [(File, start, end, [(offset, bytes_like | address, nbytes | None), ...]), ...]
        std::vector<fastdcp::WriteJob> native;
        std::vector<std::shared_ptr<File>> files;
        std::vector<py::buffer_info> keep;
        native.reserve(jobs.size());
        for (const auto& job_obj : jobs) {
          auto job = job_obj.cast<py::tuple>();
          auto file = job[0].cast<std::shared_ptr<File>>();
          fastdcp::WriteJob w{file.get(), job[1].cast<int64_t>(), job[2].cast<int64_t>(), {}};
          files.push_back(std::move(file));
          auto segs = job[3].cast<py::list>();
          w.segments.reserve(segs.size());
          int64_t last_end = w.start;
          for (const auto& seg_obj : segs) {
            auto seg = seg_obj.cast<py::tuple>();
            int64_t offset = seg[0].cast<int64_t>();
            PyBytesView v = seg[1].is_none()
                              ? PyBytesView{nullptr, seg[2].cast<size_t>()}
                              : view_of(seg[1], seg.size() > 2 ? py::object(seg[2]) : py::object(py::none()), false, keep);
            if (offset < last_end || offset + static_cast<int64_t>(v.size) > w.end) {
              throw py::value_error("write segments must be sorted, non-overlapping and inside [start, end) for '" +
                                    w.file->path() + "' (segment at " + std::to_string(offset) + ")");
            }
            last_end = offset + static_cast<int64_t>(v.size);
            w.segments.push_back({offset, v.data, v.size});
          }
          native.push_back(std::move(w));
        }
        py::gil_scoped_release release;
        engine.write(native);
      },
      py::arg("jobs"),
      "Write file images: [(File, start, end, [(offset, data, nbytes|None), ...])]. Blocks, GIL released.")
    .def(
      "read",
      [](Engine& engine, const py::list& jobs, bool direct) {
        // jobs: [(File, offset, dest_address | writable_buffer, nbytes | None), ...]
        std::vector<fastdcp::ReadJob> native;
        std::vector<std::shared_ptr<File>> files;
        std::vector<py::buffer_info> keep;
        native.reserve(jobs.size());
        for (const auto& job_obj : jobs) {
          auto job = job_obj.cast<py::tuple>();
          auto file = job[0].cast<std::shared_ptr<File>>();
          int64_t offset = job[1].cast<int64_t>();
          if (offset < 0) { throw py::value_error("negative read offset for '" + file->path() + "'"); }
          PyBytesView v = view_of(job[2], job.size() > 3 ? py::object(job[3]) : py::object(py::none()), true, keep);
          native.push_back({file.get(), offset, v.data, v.size});
          files.push_back(std::move(file));
        }
        py::gil_scoped_release release;
        engine.read(native, direct);
      },
      py::arg("jobs"), py::arg("direct") = false,
      "Read [(File, offset, dest, nbytes|None), ...] exactly; a short file raises EOFError.")
    .def(
      "read_runs",
      [](Engine& engine, const py::list& tables, bool direct) {
        // tables: [(File, address of an int64 [n, 3] row-major table, n), ...]; each row is
        // (file_offset, dest_address, nbytes). Tables are built with torch ops, so a reshard's
        // thousands of runs never become Python objects.
        std::vector<fastdcp::ReadJob> native;
        std::vector<std::shared_ptr<File>> files;
        for (const auto& entry_obj : tables) {
          auto entry = entry_obj.cast<py::tuple>();
          auto file = entry[0].cast<std::shared_ptr<File>>();
          const auto* rows = reinterpret_cast<const int64_t*>(address(entry[1].cast<uint64_t>()));
          const auto n = entry[2].cast<int64_t>();
          for (int64_t i = 0; i < n; ++i) {
            const int64_t offset = rows[3 * i], dest = rows[3 * i + 1], nbytes = rows[3 * i + 2];
            if (offset < 0 || nbytes < 0) { throw py::value_error("negative offset or size in a read table for '" + file->path() + "'"); }
            if (nbytes > 0) { native.push_back({file.get(), offset, address(static_cast<uint64_t>(dest)), static_cast<size_t>(nbytes)}); }
          }
          files.push_back(std::move(file));
        }
        py::gil_scoped_release release;
        engine.read(native, direct);
      },
      py::arg("tables"), py::arg("direct") = false,
      "Read runs given as int64 [n, 3] tables of (file_offset, dest_address, nbytes).")
    .def(
      "crc32c",
      [](Engine& engine, const py::list& regions) {
        // regions: [(address | bytes_like, nbytes | None[, seed]), ...] -> [crc32c, ...], one task
        // each; a seed continues an earlier checksum (crc of a+b = crc of b seeded with crc of a).
        std::vector<PyBytesView> views;
        std::vector<uint32_t> seeds;
        std::vector<py::buffer_info> keep;
        views.reserve(regions.size());
        for (const auto& region_obj : regions) {
          auto region = region_obj.cast<py::tuple>();
          views.push_back(view_of(region[0], region.size() > 1 ? py::object(region[1]) : py::object(py::none()), false, keep));
          seeds.push_back(region.size() > 2 ? region[2].cast<uint32_t>() : 0u);
        }
        std::vector<uint32_t> crcs(views.size());
        {
          py::gil_scoped_release release;
          engine.pool().run_batch(views.size(), [&](size_t i, int) { crcs[i] = fastdcp::crc32c(views[i].data, views[i].size, seeds[i]); });
        }
        return crcs;
      },
      py::arg("regions"), "CRC-32C of each region, computed in parallel on the engine's threads.")
    .def(
      "sync",
      [](Engine& engine, const std::vector<std::shared_ptr<File>>& files, bool data_only) {
        std::vector<File*> raw;
        for (const auto& f : files) { raw.push_back(f.get()); }
        py::gil_scoped_release release;
        engine.sync(raw, data_only);
      },
      py::arg("files"), py::arg("data_only") = false)
    .def(
      "box_copy_table",
      [](Engine& engine, uint64_t table, int64_t num_boxes) {
        if (num_boxes < 0) { throw py::value_error("negative box count"); }
        if (num_boxes > 0 && table == 0) { throw py::value_error("null box table"); }
        py::gil_scoped_release release;
        fastdcp::box_copy_cpu(reinterpret_cast<const fastdcp::BoxCopy*>(address(table)),
                              static_cast<size_t>(num_boxes), engine.pool());
      },
      py::arg("table_address"), py::arg("num_boxes"),
      "Copy num_boxes packed BoxCopy descriptors (host memory, the layout prepare_boxes and the "
      "CUDA kernel take) on the engine's threads, as box_copy does with tuples. Raises ValueError "
      "naming the first invalid box before any byte moves.")
    .def(
      "box_copy",
      [](Engine& engine, const py::list& boxes, bool streaming, bool prefault) {
        // boxes: [(src_addr, dst_addr, src_kind, dst_kind, src_elem, dst_elem, shape, src_stride, dst_stride)]
        std::vector<fastdcp::BoxCopy> native(boxes.size());
        size_t i = 0;
        for (const auto& box_obj : boxes) {
          auto t = box_obj.cast<py::tuple>();
          auto& b = native[i++];
          b.src = address(t[0].cast<uint64_t>());
          b.dst = address(t[1].cast<uint64_t>());
          b.src_kind = t[2].cast<int32_t>();
          b.dst_kind = t[3].cast<int32_t>();
          b.src_elem_size = t[4].cast<int32_t>();
          b.dst_elem_size = t[5].cast<int32_t>();
          auto shape = t[6].cast<std::vector<int64_t>>();
          auto ss = t[7].cast<std::vector<int64_t>>();
          auto ds = t[8].cast<std::vector<int64_t>>();
          if (shape.size() > static_cast<size_t>(fastdcp::kMaxBoxDims) || ss.size() != shape.size() ||
              ds.size() != shape.size()) {
            throw py::value_error("box has too many dimensions or mismatched strides");
          }
          b.ndim = static_cast<int32_t>(shape.size());
          for (size_t d = 0; d < shape.size(); ++d) {
            b.shape[d] = shape[d];
            b.src_stride[d] = ss[d];
            b.dst_stride[d] = ds[d];
          }
          fastdcp::simplify_box(b);
        }
        py::gil_scoped_release release;
        fastdcp::box_copy_cpu(native.data(), native.size(), engine.pool(), size_t{1} << 20, streaming, prefault);
      },
      py::arg("boxes"), py::arg("streaming") = false, py::arg("prefault") = false,
      "Batched strided copy (with dtype conversion) on the engine's threads; streaming: non-temporal "
      "stores for large equal-dtype runs (for destinations already faulted in); prefault: each task "
      "first has the kernel fault in its whole destination pages (for fresh destinations).")
    .def("stats", [](const Engine& engine) {
      auto s = engine.stats();
      py::dict d;
      d["bytes_written"] = s.bytes_written;
      d["bytes_read"] = s.bytes_read;
      d["write_tasks"] = s.write_tasks;
      d["read_tasks"] = s.read_tasks;
      d["bounce_bytes"] = s.bounce_bytes;
      return d;
    });
}
