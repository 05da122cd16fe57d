"""The first ``dcp.async_save`` of a fresh process, run in a child by the ``async_first`` scenario.

Inside one benchmark process no system's "first" save is a first save of a process: stock's
staging allocates with the process's allocator, which hands back memory that earlier saves freed,
already faulted in (stock's "1st" process-mode save to ``/dev/shm`` blocked 0.10 s in one suite
run, against 0.21-0.24 s in a fresh process), while fastdcp's is measured after
``release_staging()``, from new pages. A training job's first checkpoint comes once per process,
after the model is built: this child builds the LLM-like state, (process mode) starts DCP's
checkpoint daemon with an untimed warm-up save, times one ``async_save`` of the state through
``checkpoint_id=`` with a new writer (blocked: until ``async_save`` returned, plus its staging
future when it returns one; durable: until the upload finished), checks that the checkpoint
loads bit-exact with the system's reader and with stock's, and writes the times as JSON.

``python -m fastdcp.bench.first_save --system NAME --mode thread|process --path DIR --size BYTES
--out FILE``
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch.distributed.checkpoint as dcp

__all__ = ["first_async_save", "main"]


def first_async_save(system_name: str, mode: str, path: str, size: int,
                     corrupt_after_load: bool = False) -> dict[str, float]:
    """Blocked and durable seconds of this process's first ``async_save`` of the LLM-like state
    of ``size`` bytes by ``system_name`` into ``path`` (see the module docstring); raises
    VerificationError when the checkpoint does not load back bit-exact. ``corrupt_after_load``:
    the benchmark's test hook (``--corrupt-after-load``): one byte of the loaded state flipped."""
    from .scenarios import _async_kwargs, _ProcessMode, verify_with_stock_reader
    from .state import build_destination, build_state, corrupt_one_byte, llm_like_spec, verify_state
    from .systems import resolve_systems

    spec = llm_like_spec(size)
    state = build_state(spec)
    (system,) = resolve_systems([system_name])
    kwargs = _async_kwargs(mode)
    # Process mode: a process group and DCP's daemon, started untimed, as in `async`.
    process_mode = _ProcessMode(path + ".warmup") if mode == "process" else None
    try:
        planner = system.make_save_planner() if system.make_save_planner is not None else None
        gc.collect()
        t0 = time.perf_counter()
        resp = dcp.async_save(state, checkpoint_id=path, storage_writer=system.async_writer(path), planner=planner,
                              **kwargs)
        staging = getattr(resp, "staging_completion", None)  # AsyncSaveResponse (newer torch)
        if staging is not None:
            staging.result()
        blocked = time.perf_counter() - t0
        getattr(resp, "upload_completion", resp).result()
        durable = time.perf_counter() - t0
        loaded = build_destination(spec)
        dcp.load(loaded, storage_reader=system.make_reader(path), no_dist=True)
        if corrupt_after_load:
            corrupt_one_byte(loaded)
        verify_state(state, loaded, f"async_first/{mode} [{system.name}]")
        verify_with_stock_reader(state, spec, path, f"async_first/{mode} [{system.name}]")
        return {"blocked_s": blocked, "durable_s": durable, "bytes": spec.tensor_bytes}
    finally:
        if process_mode is not None:
            process_mode.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastdcp.bench.first_save", description=__doc__.split("\n")[0])
    parser.add_argument("--system", required=True)
    parser.add_argument("--mode", choices=("thread", "process"), required=True)
    parser.add_argument("--path", required=True, help="the checkpoint directory (must not exist)")
    parser.add_argument("--size", type=int, required=True, help="state bytes")
    parser.add_argument("--out", required=True, help="JSON file for the result")
    parser.add_argument("--corrupt-after-load", action="store_true", help="test hook: flip a loaded byte")
    a = parser.parse_args(argv)
    from .state import EXIT_VERIFY, VerificationError

    try:
        result = first_async_save(a.system, a.mode, a.path, a.size, a.corrupt_after_load)
    except VerificationError as error:
        print(f"VerificationError: {error}", file=sys.stderr)
        return EXIT_VERIFY
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
