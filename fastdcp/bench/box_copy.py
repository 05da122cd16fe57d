"""`box_copy` scenario: fastdcp's batched box copy alone, against torch's per-piece ``copy_``.

A load places stored pieces into destination tensors. Stock DCP does it with one
``Tensor.copy_`` per read item (``narrow`` + ``copy_``); fastdcp with one batched box copy: on the
GPU one launch of the box-copy kernel (``_C.launch_box_copy``, csrc/cuda/) for every piece of a
batch, on the CPU the engine's threads (``Engine.box_copy``). This scenario times that step alone,
with no storage, on the same pieces:

* ``layout=same``: every piece is a whole matrix (one box per destination, contiguous);
* ``layout=column``: every destination matrix receives two column halves (the pieces a
  ``Shard(1)`` load places: contiguous source, destination rows strided by the full width).

Systems: ``fastdcp`` = the box copy; ``stock`` = ``copy_`` per piece, as stock's reader does.
The limit is a contiguous copy of the same bytes on the same device (``d2d`` on the GPU, the
``memcpy`` probe on the CPU); bytes are counted once (the payload). Each result is the best of a
few rounds after a warm-up, and every destination is compared bit-exact with the source pieces
(a mismatch raises VerificationError).

On a machine without CUDA (or an extension built without it) the CPU variant runs, so the
scenario's code paths run in every test run; ``--scenarios box_copy`` picks it, it is in no
default list.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..io.boxes import BOX_BYTES, RAW, Box, pack_boxes
from .state import VerificationError

SCENARIO = "box_copy"
ROUNDS = 5
COLUMNS = 2048                    # bfloat16 elements per destination row (4 KiB)
MATRICES = 8


def _matrix_rows(total_bytes: int) -> int:
    per_matrix = max(total_bytes // MATRICES, COLUMNS * 2 * 2)
    return max(2, per_matrix // (COLUMNS * 2) // 2 * 2)


def _pieces(layout: str, src: torch.Tensor, dests: list[torch.Tensor]
            ) -> tuple[list[Box], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The pieces that place consecutive bytes of the flat `src` buffer into `dests`: as boxes
    (``fastdcp.io.boxes``) and as (source view, destination view) pairs."""
    boxes: list[Box] = []
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    offset = 0
    for d in dests:
        cols = d.shape[1]
        for part in [d] if layout == "same" else [d[:, : cols // 2], d[:, cols // 2:]]:
            elem, n = part.element_size(), part.numel() * part.element_size()
            boxes.append(Box(src.data_ptr() + offset, part.data_ptr(), RAW, RAW, elem, elem, tuple(part.shape),
                             (part.shape[1], 1), tuple(part.stride())))
            pairs.append((src[offset: offset + n].view(part.dtype).view(part.shape), part))
            offset += n
    return boxes, pairs


def _best(fn: Callable[[], None], sync: Callable[[], None], rounds: int = ROUNDS) -> float:
    fn()  # warm-up (first launch, allocator, page faults)
    sync()
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _verify(pairs: list[tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
    for i, (piece, part) in enumerate(pairs):
        if not torch.equal(piece.view(torch.int16), part.view(torch.int16)):
            raise VerificationError(f"{what}: piece {i} differs from its source after the copy")


def _kernel_copy(boxes: list[Box], device: torch.device) -> Callable[[], None]:
    """One launch of the box-copy kernel for every box, on the current stream; the descriptors
    are prepared once (as a load does per batch) and live in device memory."""
    from .._native import _C

    n = len(boxes)
    table_bytes = n * BOX_BYTES
    host = torch.empty(table_bytes + (n + 1) * 8, dtype=torch.uint8, pin_memory=True)
    host[:table_bytes].copy_(torch.frombuffer(pack_boxes(boxes), dtype=torch.uint8))
    total = _C.prepare_boxes(host.data_ptr(), n, host.data_ptr() + table_bytes)
    table = host.to(device)
    stream = torch.cuda.current_stream(device)

    any_conversion = any(b.src_kind != b.dst_kind for b in boxes)

    def run() -> None:
        _C.launch_box_copy(table.data_ptr(), table.data_ptr() + table_bytes, n, total, stream.cuda_stream,
                           any_conversion=any_conversion)

    run.keep_alive = (host, table)  # type: ignore[attr-defined]
    return run


def run_box_copy(ctx, wheres: list[str]) -> None:
    """Times the box copy and stock's copy_ per piece on the GPU (CUDA build and device) or the
    CPU, for each layout; results into ctx.recorder under where = "cuda" / "cpu"."""
    fast = next((s for s in ctx.systems if s.name == "fastdcp"), None)
    if fast is None or fast.standin:
        ctx.note(f"{SCENARIO} skipped: it measures fastdcp's box copy (fastdcp not in --systems, or a stand-in)")
        return
    from .._native import _C

    cuda = bool(_C.build_info().get("cuda")) and hasattr(_C, "launch_box_copy") and torch.cuda.is_available()
    if torch.cuda.is_available() and not cuda:
        ctx.note(f"{SCENARIO}: CUDA is available but the extension has no box-copy kernel (built without CUDA): "
                 f"the CPU box copy is measured instead")
    device = torch.device("cuda") if cuda else torch.device("cpu")
    where = device.type
    total = max(1 << 20, min(ctx.cfg.size, 2 << 30))
    rows = _matrix_rows(total)
    dests = [torch.empty(rows, COLUMNS, dtype=torch.bfloat16, device=device) for _ in range(MATRICES)]
    nbytes = sum(d.numel() * d.element_size() for d in dests)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    limit = "d2d" if cuda else "memcpy"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    threads = max(1, torch.get_num_threads())
    engine = None if cuda else _C.Engine(threads, 1 << 20)
    try:
        for layout in ("same", "column"):
            boxes, pairs = _pieces(layout, src, dests)
            if cuda:
                fast_copy = _kernel_copy(boxes, device)
                what = "_C.launch_box_copy: one kernel launch for every piece"
            else:
                fast_copy = lambda: engine.box_copy(boxes)  # noqa: E731
                what = f"_C.Engine({threads} threads).box_copy"

            def stock_copy() -> None:
                for piece, part in pairs:
                    part.copy_(piece)

            config = {"layout": layout, "pieces": len(boxes), "device": where}
            for name, fn, descr in (("stock", stock_copy, {"copy": "Tensor.copy_ per piece (stock's reader)"}),
                                    ("fastdcp", fast_copy, {"copy": what})):
                for d in dests:
                    d.fill_(0)
                seconds = _best(fn, sync)
                _verify(pairs, f"{SCENARIO}/{where}/{layout}/{name}")
                ctx.recorder.add(SCENARIO, where, name, config, nbytes, seconds, limit, descr)
                ctx.progress(f"{SCENARIO:<8} {where:<4} {name:<10} {layout:<7} {len(boxes)} pieces: "
                             f"{seconds * 1e3:8.3f} ms  {nbytes / seconds / (1 << 30):7.2f} GiB/s")
    finally:
        del src, dests
        if cuda:
            torch.cuda.empty_cache()
