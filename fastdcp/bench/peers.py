"""Peers: other ways to checkpoint the same state, run in the same interleaved save loop as the
DCP systems (and, where they have a natural load, in the load scenario):

* ``torch_save``     ``torch.save(state_dict, f)`` into one file, then ``f.flush()`` + ``os.fsync``;
                     load: ``torch.load(path, map_location="cpu", weights_only=True)``, then
                     ``copy_`` into the preallocated destination (what ``load_state_dict`` does).
* ``safetensors``    ``safetensors.torch.save_file(tensors, path, metadata=...)`` + ``os.fsync``:
                     tensors only; non-tensor entries (``step``, ``run_info``) go in the header's
                     metadata as JSON (an entry JSON cannot hold is skipped, with a note); a tensor
                     that shares storage with another or is not contiguous is cloned / made
                     contiguous first (inside the timing), as a user would.
                     load: ``safetensors.torch.load_file(path)`` + ``copy_`` into the destination,
                     the metadata through ``safe_open(path).metadata()``.
* ``torchsnapshot``  ``Snapshot.take(path, app_state={"state": StateDict(**state_dict)})``, then an
                     fsync of every file and directory it wrote (it does not fsync itself);
                     load: ``Snapshot(path).restore(app_state={"state": StateDict(**dest)})``
                     (restores tensors in place).
* ``nvrx_async``     NVIDIA nvidia-resiliency-ext ``FileSystemWriterAsync`` driven as Megatron-Core's
                     ``torch_dist`` strategy drives it: a new writer per checkpoint
                     (``thread_count=2``, Megatron's default), ``save_state_dict_async_plan(sd,
                     writer, None, 0, planner=DefaultSavePlanner())``, then the function and
                     arguments of ``writer.get_save_function_and_args()`` executed here,
                     synchronously (Megatron's async caller runs them in a background process;
                     the benchmark measures the full durable save): the ``preload_fn`` staging
                     first (without CUDA: ``FileSystemWriterAsync.preload_tensors(buckets,
                     non_blocking=False)``, since ``preload_fn`` calls ``torch.cuda.synchronize``),
                     then ``save_fn(*args)`` (forks ``thread_count`` writer processes, one file
                     each, fsynced), then ``save_state_dict_async_finalize(*plan_result)``
                     (writes ``.metadata``). It writes DCP format: it is verified by loading
                     with stock ``FileSystemReader`` (that load is the stock reader's, so it
                     is not added to the load scenario). It needs a default process group
                     (``torch.distributed.get_rank()``): a 1-rank gloo group is started around
                     each of its saves, untimed, when none exists. Its results queue (a
                     ``multiprocessing`` Manager, spawned once per process) is started by an
                     untimed warm-up save.

Every peer's save ends with an fsync of its checkpoint directory, as fastdcp's commit does (stock
DCP fsyncs its files, not the directory). ``stock_best`` (stock ``FileSystemWriter`` with
``thread_count=4``) counts as a peer in the "fastdcp vs best peer" comparison.

Every peer is optional: one that does not import (or whose untimed warm-up save fails for another
reason than a verification mismatch) is left out with a note saying why and how to install it;
``pip install -e .[bench]`` installs them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .process_group import OneRankGroup
from .state import VerificationError, scribble, verify_state

PEER_NAMES = ("torch_save", "safetensors", "torchsnapshot", "nvrx_async")
# DCP systems that count as peers in "fastdcp vs best peer"
DCP_PEERS = ("stock_best",)
# scenarios the peers run in (the summary's "fastdcp vs best peer" lines are about these)
PEER_SCENARIOS = ("save", "load")
INSTALL_HINT = {
    "torch_save": "it comes with torch",
    "safetensors": "pip install safetensors",
    "torchsnapshot": "pip install torchsnapshot",
    "nvrx_async": "pip install nvidia-resiliency-ext",
}


def is_peer(name: str) -> bool:
    return name in PEER_NAMES or name in DCP_PEERS


class PeerUnavailable(RuntimeError):
    """A peer cannot run here; the message says why and how to install it."""


@dataclass
class Peer:
    """A checkpointing method other than DCP's storage layers.

    ``save(sd, path)`` writes a durable checkpoint of ``sd`` into the new directory ``path``;
    ``load(dest, path)`` fills the preallocated ``dest`` in place (tensors copied into, objects
    assigned); ``in_load_scenario``: whether that load is the peer's own (False for nvrx_async,
    whose checkpoints are read by stock FileSystemReader)."""

    name: str
    save: Callable[[dict[str, Any], str], None]
    load: Callable[[dict[str, Any], str], None]
    marker: str                                 # a file that exists once `path` holds a checkpoint
    description: dict[str, Any] = field(default_factory=dict)
    in_load_scenario: bool = True
    skipped: set[str] = field(default_factory=set)   # entries the format cannot hold (not verified)
    # entered around a timed save, outside the timing (nvrx_async: its process group)
    session: Callable[[], Any] = contextlib.nullcontext
    notes: list[str] = field(default_factory=list)

    def exists(self, path: str) -> bool:
        return os.path.exists(os.path.join(path, self.marker))

    def verify(self, expected: dict[str, Any], dest: dict[str, Any], path: str, what: str) -> None:
        """Load `path` into `dest` (scribbled first) and compare bit-exact with `expected`."""
        scribble(dest)
        self.load(dest, path)
        verify_state({k: v for k, v in expected.items() if k not in self.skipped}, dest,
                     f"{what} [{self.name}]")


# --------------------------------------------------------------------------- helpers

def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file, then every directory (deepest first), under `root`."""
    dirs = []
    for dirpath, _, files in os.walk(root):
        dirs.append(dirpath)
        for f in files:
            fsync_path(os.path.join(dirpath, f))
    for d in reversed(dirs):
        fsync_path(d)


def _fill(dest: dict[str, Any], loaded: dict[str, Any], where: str) -> None:
    """Copy a loaded flat state dict into the preallocated destination (load_state_dict)."""
    extra = [k for k in loaded if k not in dest]
    if extra:
        raise VerificationError(f"{where}: unexpected entries in the checkpoint: {extra[:5]}")
    for k, v in loaded.items():
        d = dest[k]
        if isinstance(d, torch.Tensor):
            if not isinstance(v, torch.Tensor) or v.shape != d.shape or v.dtype != d.dtype:
                raise VerificationError(f"{where}: {k!r} loaded as {type(v).__name__} "
                                        f"{getattr(v, 'shape', '')} {getattr(v, 'dtype', '')}, "
                                        f"expected {tuple(d.shape)} {d.dtype}")
            d.copy_(v)
        else:
            dest[k] = v


# --------------------------------------------------------------------------- torch.save

def _torch_save() -> Peer:
    fname = "model.pt"

    def save(sd: dict[str, Any], path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, fname), "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(path)

    def load(dest: dict[str, Any], path: str) -> None:
        loaded = torch.load(os.path.join(path, fname), map_location="cpu", weights_only=True)
        _fill(dest, loaded, "torch_save load")

    return Peer("torch_save", save, load, fname,
                {"save": "torch.save(sd, f) into one file + f.flush() + os.fsync(f) + fsync(dir)",
                 "load": "torch.load(path, map_location='cpu', weights_only=True) + copy_ into the "
                         "destination", "torch": torch.__version__})


# --------------------------------------------------------------------------- safetensors

_OBJ_PREFIX = "obj:"


def _safetensors() -> Peer:
    try:
        import safetensors
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file
    except Exception as exc:
        raise PeerUnavailable(f"safetensors not run: not importable ({type(exc).__name__}: {exc}); "
                              f"install: {INSTALL_HINT['safetensors']}") from exc
    fname = "model.safetensors"
    peer: Peer

    def split(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, str] = {"format": "pt"}
        seen: set[int] = set()
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                t = v.detach()
                storage = t.untyped_storage()
                shared = storage.data_ptr() in seen and t.numel() > 0
                partial = storage.nbytes() != t.numel() * t.element_size()
                if shared or partial:        # safetensors refuses shared storage: own copy
                    t = t.clone(memory_format=torch.contiguous_format)
                elif not t.is_contiguous():
                    t = t.contiguous()
                seen.add(storage.data_ptr())
                tensors[k] = t
            else:
                try:
                    meta[_OBJ_PREFIX + k] = json.dumps(v)
                except (TypeError, ValueError):
                    if k not in peer.skipped:
                        peer.skipped.add(k)
                        peer.notes.append(f"safetensors: non-tensor entry {k!r} "
                                          f"({type(v).__name__}) is not JSON: not saved, not verified")
        return tensors, meta

    def save(sd: dict[str, Any], path: str) -> None:
        os.makedirs(path, exist_ok=True)
        tensors, meta = split(sd)
        f = os.path.join(path, fname)
        save_file(tensors, f, metadata=meta)
        fsync_path(f)
        fsync_path(path)

    def load(dest: dict[str, Any], path: str) -> None:
        f = os.path.join(path, fname)
        loaded: dict[str, Any] = dict(load_file(f, device="cpu"))
        with safe_open(f, framework="pt", device="cpu") as h:
            meta = h.metadata() or {}
        for k, v in meta.items():
            if k.startswith(_OBJ_PREFIX):
                loaded[k[len(_OBJ_PREFIX):]] = json.loads(v)
        _fill(dest, loaded, "safetensors load")

    peer = Peer("safetensors", save, load, fname,
                {"save": "safetensors.torch.save_file(tensors, path, metadata={non-tensor entries as "
                         "JSON}) + os.fsync(file) + fsync(dir); shared/partial storages cloned, "
                         "non-contiguous made contiguous",
                 "load": "safetensors.torch.load_file(path) + copy_ into the destination; "
                         "safe_open(path).metadata() for the non-tensor entries",
                 "safetensors": getattr(safetensors, "__version__", "?")})
    return peer


# --------------------------------------------------------------------------- torchsnapshot

def _torchsnapshot() -> Peer:
    try:
        import torchsnapshot
        from torchsnapshot import Snapshot, StateDict
    except Exception as exc:
        raise PeerUnavailable(f"torchsnapshot not run: not importable ({type(exc).__name__}: {exc}); "
                              f"install: {INSTALL_HINT['torchsnapshot']}") from exc

    def save(sd: dict[str, Any], path: str) -> None:
        with warnings.catch_warnings():  # TypedStorage deprecation, once per tensor
            warnings.simplefilter("ignore", UserWarning)
            Snapshot.take(path, app_state={"state": StateDict(**sd)})
        fsync_tree(path)

    def load(dest: dict[str, Any], path: str) -> None:
        st = StateDict(**dest)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            Snapshot(path).restore(app_state={"state": st})
        # tensors are restored in place; objects (and any tensor not restored in place) are
        # copied back from the StateDict wrapper
        _fill(dest, {k: v for k, v in st.items() if v is not dest.get(k)}, "torchsnapshot restore")

    return Peer("torchsnapshot", save, load, ".snapshot_metadata",
                {"save": "Snapshot.take(path, app_state={'state': StateDict(**sd)}) + fsync of every "
                         "file and directory written",
                 "load": "Snapshot(path).restore(app_state={'state': StateDict(**dest)}) (in place)",
                 "torchsnapshot": getattr(torchsnapshot, "__version__", "?")})


# --------------------------------------------------------------------------- nvidia-resiliency-ext

def _nvrx_async(thread_count: int = 2) -> Peer:
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            raise RuntimeError("torch.distributed with gloo is not available in this torch build")
        from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fsa
        from nvidia_resiliency_ext.checkpointing.async_ckpt import state_dict_saver as sds

        writer_cls = fsa.FileSystemWriterAsync
        plan_fn, finalize_fn = sds.save_state_dict_async_plan, sds.save_state_dict_async_finalize
    except Exception as exc:
        raise PeerUnavailable(f"nvrx_async not run: nvidia-resiliency-ext's async checkpointing is not "
                              f"importable ({type(exc).__name__}: {exc}); install: "
                              f"{INSTALL_HINT['nvrx_async']}") from exc
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
    import torch.distributed.checkpoint as dcp

    try:
        from importlib.metadata import version
        nvrx_version = version("nvidia-resiliency-ext")
    except Exception:
        nvrx_version = "?"
    cuda = torch.cuda.is_available()

    def save(sd: dict[str, Any], path: str) -> None:
        with OneRankGroup():  # a no-op inside the benchmark's untimed session (the group exists)
            writer = writer_cls(path, thread_count=thread_count)
            ret = plan_fn(sd, writer, None, 0, planner=DefaultSavePlanner())
            if isinstance(ret[0], tuple):  # versions that also return the cached plans
                ret = ret[0]
            fn_args = writer.get_save_function_and_args()
            if len(fn_args) == 3:
                save_fn, preload_fn, args = fn_args
            else:  # older: (save_fn, args)
                (save_fn, args), preload_fn = fn_args, None
            if save_fn is not None:
                args = list(args)
                if preload_fn is not None and cuda:
                    args[1] = preload_fn()
                elif hasattr(writer, "preload_tensors"):  # preload_fn needs CUDA (synchronize)
                    args[1] = writer.preload_tensors(args[1], non_blocking=False)
                save_fn(*args)
            finalize_fn(*ret)
        fsync_path(path)

    def load(dest: dict[str, Any], path: str) -> None:
        dcp.load(dest, storage_reader=FileSystemReader(path), no_dist=True)

    return Peer("nvrx_async", save, load, ".metadata",
                {"save": f"FileSystemWriterAsync(path, thread_count={thread_count}) (new per checkpoint) "
                         "-> save_state_dict_async_plan(sd, writer, None, 0, DefaultSavePlanner()) -> "
                         "get_save_function_and_args(): preload + save_fn(*args) run synchronously "
                         "here -> save_state_dict_async_finalize(*plan) (.metadata) + fsync(dir)",
                 "preload": "preload_fn() (CUDA)" if cuda else
                            "FileSystemWriterAsync.preload_tensors(buckets, non_blocking=False): "
                            "preload_fn calls torch.cuda.synchronize, unavailable without CUDA",
                 "load": "verified with stock FileSystemReader (DCP format)",
                 "process_group": "1-rank gloo group started before and destroyed after each save "
                                  "(untimed) when none exists",
                 "warm_up": "results queue (multiprocessing Manager) started by an untimed warm-up save",
                 "nvidia-resiliency-ext": nvrx_version},
                in_load_scenario=False, session=OneRankGroup)


_BUILDERS: dict[str, Callable[[], Peer]] = {
    "torch_save": _torch_save,
    "safetensors": _safetensors,
    "torchsnapshot": _torchsnapshot,
    "nvrx_async": _nvrx_async,
}


def resolve_peers(names: list[str] | tuple[str, ...], notes: list[str] | None = None) -> list[Peer]:
    """Peer objects for `names`, in order. A peer that cannot be built is left out with a note
    appended to `notes` (never silently); without a `notes` list it raises PeerUnavailable."""
    out: list[Peer] = []
    for n in names:
        if n not in _BUILDERS:
            raise ValueError(f"unknown peer {n!r}; choose from {', '.join(PEER_NAMES)}")
        try:
            out.append(_BUILDERS[n]())
        except PeerUnavailable as exc:
            if notes is None:
                raise
            notes.append(str(exc))
    return out


def warm_up(peer: Peer, root: str) -> None:
    """Untimed: a tiny save + verified load of `peer` under `root` (then removed). Imports, lazy
    initialisation (nvrx's results queue process) and any failure to run here happen now, not
    in a timed save. Raises VerificationError on a mismatch, anything else when it cannot run."""
    path = os.path.join(root, "peer_warmup", peer.name)
    sd = {"warmup.a": torch.arange(4096, dtype=torch.float32),
          "warmup.b": torch.arange(512, dtype=torch.int16).view(16, 32).to(torch.bfloat16),
          "step": 3, "run_info": "warm-up"}
    dest = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        peer.save(sd, path)
        peer.verify(sd, dest, path, "peer warm-up")
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def prepare_peers(peers: list[Peer], root: str, note: Callable[[str], None]) -> list[Peer]:
    """Warm up every peer (untimed); one that cannot run is left out with a note saying why.
    A verification mismatch is not a reason to leave it out: VerificationError propagates."""
    ok: list[Peer] = []
    for p in peers:
        try:
            warm_up(p, root)
        except VerificationError:
            raise
        except Exception as exc:
            note(f"{p.name} not run: its untimed warm-up save failed here ({type(exc).__name__}: "
                 f"{str(exc).splitlines()[0] if str(exc) else ''})")
            continue
        ok.append(p)
    return ok
