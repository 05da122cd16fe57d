"""Subprocess helper for the crash and fault tests: a "zygote" that imports torch once and forks
a fresh child process per experiment, so that a test can SIGKILL dozens of real saving processes
without paying the torch import each time.

Run as ``python tests/_crash_worker.py``; it reads JSON commands from stdin, one per line, and
answers one JSON line each on stdout:

* ``{"op": "fork", "job": {...}}`` -> ``{"pid": N}``: forks a child that runs ``job`` (see
  :func:`run_job`) and exits 0, or 3 after writing the exception to ``job["error_file"]``.
* ``{"op": "wait", "pid": N}`` -> ``{"status": S, "signal": K|null, "code": C|null}``: reaps it.
* ``{"op": "prepare", "seed": S, "scale": X}`` -> ``{}``: draws the random tensors states are
  made from (:func:`make_state`) once, so children only roll them.
* ``{"op": "exit"}``: the zygote exits.

The zygote runs torch single-threaded and starts no thread of its own, so forking it is safe.
The tests import :func:`make_state` from here as well (one definition of every state).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
import warnings

# Every state is a few MiB in several tensors, spread over two files per save (thread_count=2).
_SHAPES = {
    "w0": ((512, 512), "float32"),
    "w1": ((1024, 512), "bfloat16"),
    "w2": ((256, 1024), "float32"),
    "w3": ((300, 700), "float16"),
    "bias": ((1000,), "float32"),
    "idx": ((300, 7), "int64"),
}


_BASES: dict = {}


def make_state(seed: int, k: int, scale: int = 1) -> dict:
    """State number ``k`` of a run. Random tensors drawn once per (seed, scale), rolled by ``k``
    rows for state ``k`` (cheap, so a saving process spends its time saving): every tensor of
    state k differs from the same tensor of any state k' with 0 < |k - k'| < 256, so a directory
    mixing two states' files never compares equal to either. ``scale`` multiplies the first
    dimension of the big tensors (for fault tests that need more bytes)."""
    import torch

    key = (seed, scale)
    if key not in _BASES:
        g = torch.Generator().manual_seed(seed)
        bases = {}
        for name, (shape, dtype) in _SHAPES.items():
            if name.startswith("w"):
                shape = (shape[0] * scale,) + shape[1:]
            dt = getattr(torch, dtype)
            if dt.is_floating_point:
                bases[name] = torch.randn(shape, generator=g).to(dt)
            else:
                bases[name] = torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dt)
        _BASES[key] = bases
    state: dict = {name: base.roll(k, 0) for name, base in _BASES[key].items()}
    state["step"] = k
    state["tag"] = f"state-{seed}-{k}"
    return state


def template_like(state: dict) -> dict:
    """A destination for ``dcp.load`` with the same keys, shapes and dtypes, and sentinel values."""
    import torch

    return {
        key: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for key, v in state.items()
    }


def states_equal(a: dict, b: dict) -> bool:
    """Bit-exact equality of two states (tensors compared as raw bytes, so NaN payloads count)."""
    import torch

    if a.keys() != b.keys():
        return False
    for key, v in a.items():
        w = b[key]
        if isinstance(v, torch.Tensor):
            if not isinstance(w, torch.Tensor) or v.dtype != w.dtype or v.shape != w.shape:
                return False
            if not torch.equal(v.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
                return False
        elif v != w:
            return False
    return True


def classify(directory: str, candidates: dict, reader: str) -> str:
    """Load ``directory`` with the ``"fast"`` or ``"stock"`` reader and say what it holds:
    ``"none"`` (no .metadata), ``"state K"`` (bit-exact one of ``candidates``, a {k: state} dict),
    ``"mixed ..."`` (loads, but equals no candidate), or ``"error ..."`` (the load failed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from fastdcp import FastFileSystemReader

    names = os.listdir(directory) if os.path.isdir(directory) else []
    if not any(n == ".metadata" or (n.startswith("__") and n.endswith(".metadata")) for n in names):
        return "none"
    some = next(iter(candidates.values()))
    dest = template_like(some)
    storage_reader = FastFileSystemReader(directory) if reader == "fast" else FileSystemReader(directory)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(dest, storage_reader=storage_reader, no_dist=True)
    except BaseException as error:  # noqa: BLE001 - CheckpointException is a BaseException
        text = str(error).strip().splitlines()
        return "error " + (text[-1] if text else type(error).__name__)
    matches = [k for k, state in candidates.items() if states_equal(dest, state)]
    if len(matches) == 1:
        return f"state {matches[0]}"
    per_key = {key: [k for k, st in candidates.items() if states_equal({key: v}, {key: st[key]})] for key, v in dest.items()}
    return f"mixed (keys -> matching states) {per_key}"


def _note(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def run_job(job: dict) -> None:
    """What a forked child does.

    ``kind``: ``"fast"`` or ``"stock"`` writer. ``dir``: checkpoint directory. ``seed``/``first``/
    ``count``: save states ``first, first+1, ...`` (``count`` 0 = forever), each into ``dir``.
    ``notes``: a file that gets ``start k`` before and ``done k`` after each save (the crash test
    reads it to know which states may legitimately be on disk). ``env``: environment to set first
    (the writer's ``FASTDCP_TEST_PAUSE_*`` hooks). ``uid``: setuid to it first, after one save
    into ``warmup_dir`` if given (so every lazily imported module is loaded while still root). ``scale``: see
    :func:`make_state`. ``thread_count``, ``use_collectives``, ``writer_kwargs`` go to the writer
    and ``dcp.save``. ``async``: save with ``dcp.async_save`` and overwrite the live tensors right
    after it returns (notes get ``staged k`` then). ``wait_staging`` (with ``async``): the
    overlapped-staging protocol (``async_staging=True`` in ``writer_kwargs``): notes get
    ``called k`` when ``async_save`` returns, then the live tensors are overwritten only once its
    ``staging_completion`` resolved (notes get ``staged k`` then).
    """
    warnings.filterwarnings("ignore")
    os.environ.update(job.get("env", {}))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from fastdcp import FastFileSystemWriter

    if job.get("warmup_dir"):
        dcp.save(make_state(job["seed"], 0), storage_writer=FastFileSystemWriter(job["warmup_dir"]), no_dist=True)
    if job.get("uid") is not None:
        os.setgid(job["uid"])
        os.setuid(job["uid"])

    if job.get("exec"):
        exec(compile(job["exec"], "<crash job>", "exec"), {"job": job})

    k = job.get("first", 0)
    count = job.get("count", 1)
    notes = job.get("notes")
    while count == 0 or k < job.get("first", 0) + count:
        state = make_state(job["seed"], k, job.get("scale", 1))
        if job.get("kind", "fast") == "fast":
            writer = FastFileSystemWriter(job["dir"], thread_count=job.get("thread_count", 2), **job.get("writer_kwargs", {}))
        else:
            writer = FileSystemWriter(job["dir"], thread_count=job.get("thread_count", 2))
        if notes:
            _note(notes, f"start {k}")
        if job.get("async"):
            # dcp.async_save: the staged copy is written in the background while the "training"
            # loop scribbles over the live tensors.
            future = dcp.async_save(state, storage_writer=writer, no_dist=True)
            if job.get("wait_staging"):
                if notes:
                    _note(notes, f"called {k}")
                staging = getattr(future, "staging_completion", None)
                if staging is not None:
                    staging.result()
            if notes:
                _note(notes, f"staged {k}")
            for value in state.values():
                if hasattr(value, "fill_") and value.numel():
                    value.fill_(7)
            getattr(future, "upload_completion", future).result()
        else:
            dcp.save(state, storage_writer=writer, no_dist=True, use_collectives=job.get("use_collectives", True))
        if notes:
            _note(notes, f"done {k}")
        k += 1


def _child(job: dict) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    code = 0
    try:
        run_job(job)
    except BaseException as error:  # noqa: BLE001 - reported to the test through a file
        code = 3
        if job.get("error_file"):
            with open(job["error_file"], "w") as f:
                f.write(f"{type(error).__name__}\n{error}\n---\n{traceback.format_exc()}")
    finally:
        sys.stdout.flush()
        os._exit(code)


def main() -> None:
    # Import the heavy modules once; children inherit them.
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import fastdcp  # noqa: F401

    torch.set_num_threads(1)  # no intra-op thread pool in the process we fork from
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd["op"] == "fork":
            pid = os.fork()
            if pid == 0:
                _child(cmd["job"])
            print(json.dumps({"pid": pid}), flush=True)
        elif cmd["op"] == "wait":
            _, status = os.waitpid(cmd["pid"], 0)
            print(
                json.dumps(
                    {
                        "status": status,
                        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                        "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                    }
                ),
                flush=True,
            )
        elif cmd["op"] == "prepare":
            make_state(cmd["seed"], 0, cmd.get("scale", 1))
            print(json.dumps({}), flush=True)
        elif cmd["op"] == "exit":
            break


class Zygote:
    """Test-side handle on a running zygote (``python tests/_crash_worker.py``)."""

    def __init__(self) -> None:
        import subprocess

        env = dict(os.environ)
        here = os.path.dirname(os.path.abspath(__file__))
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here, env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready = self._read()
        assert "ready" in ready, ready

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"crash worker zygote died (exit code {self.proc.poll()})")
        return json.loads(line)

    def _send(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def fork(self, job: dict) -> int:
        return self._send({"op": "fork", "job": job})["pid"]

    def prepare(self, seed: int, scale: int = 1) -> None:
        self._send({"op": "prepare", "seed": seed, "scale": scale})

    def wait(self, pid: int) -> dict:
        return self._send({"op": "wait", "pid": pid})

    def kill(self, pid: int) -> dict:
        """SIGKILL the child and wait until it is gone (every thread, every in-flight syscall)."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.wait(pid)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main()
