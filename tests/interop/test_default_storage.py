"""``fastdcp.enable()`` / ``disable()``: DCP's own storage choice switched to fastdcp and back.

Real files, stock DCP on the other side: ``dcp.save`` / ``dcp.load`` / ``dcp.async_save`` with
only ``checkpoint_id=`` must write fastdcp checkpoints (data files named ``__{rank}_{token}_{i}``,
stock writes ``__{rank}_{i}``) and read through ``FastFileSystemReader`` (a spy on its
``read_data``); stock's ``FileSystemReader`` must load them bit-exact; ``disable()`` must give back
stock's exact function objects. One 2-process gloo run covers save, load and both async_save modes
with a process group; a moved hook must make ``enable()`` raise.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import traceback
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import _storage_utils, state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import dcp_cases as C
import fastdcp
from fastdcp import FastFileSystemReader, FastFileSystemWriter, FastS3Reader, FastS3Writer, HookNotFoundError
from fastdcp import default_storage
from fastdcp.bench.process_group import exit_spawned_rank

FAST_NAME = re.compile(r"__(\d+)_[0-9a-f]{8}_\d+\.distcp")
STOCK_NAME = re.compile(r"__(\d+)_\d+\.distcp")

# What every test must find again after it: stock's own function objects, nothing enabled.
fastdcp.disable()  # in case FASTDCP_ENABLE=1 is set around the test run
STOCK = {
    (_storage_utils, "_storage_setup"): _storage_utils._storage_setup,
    (state_dict_saver, "_storage_setup"): state_dict_saver._storage_setup,
    (state_dict_loader, "_storage_setup"): state_dict_loader._storage_setup,
    (state_dict_saver, "async_save"): state_dict_saver.async_save,
    (dcp, "async_save"): dcp.async_save,
}


def _stock_objects_in_place() -> list[str]:
    return [f"{m.__name__}.{name}" for (m, name), stock in STOCK.items() if getattr(m, name) is not stock]


@pytest.fixture(autouse=True)
def _leaves_stock_behind():
    fastdcp.disable()
    yield
    enabled_at_end = fastdcp.is_enabled()
    fastdcp.disable()
    assert not enabled_at_end, "a test left fastdcp enabled"
    assert _stock_objects_in_place() == []


@pytest.fixture
def read_data_calls(monkeypatch) -> list[type]:
    """The classes of the FastFileSystemReader objects whose read_data ran."""
    calls: list[type] = []
    original = FastFileSystemReader.read_data

    def spy(self, plan, planner):
        calls.append(type(self))
        return original(self, plan, planner)

    monkeypatch.setattr(FastFileSystemReader, "read_data", spy)
    return calls


def state(seed: int = 0) -> dict[str, Any]:
    return {
        "w": C.random_tensor(torch.float32, (64, 33), ("enable", "w", seed)),
        "b": C.random_tensor(torch.bfloat16, (7, 130), ("enable", "b", seed)),
        "step": 100 + seed,
    }


def data_files(path: Path) -> list[str]:
    return sorted(p.name for p in Path(path).iterdir() if p.suffix == ".distcp")


def assert_written_by(kind: str, path: Path) -> None:
    names = data_files(path)
    pattern = FAST_NAME if kind == "fast" else STOCK_NAME
    assert names and all(pattern.fullmatch(n) for n in names), f"expected {kind} data files in {path}, found {names}"


def assert_stock_loads(path: Path, expected: dict[str, Any]) -> None:
    """Stock's FileSystemReader, explicitly, into fresh destinations: bit-exact."""
    C.load_in_place_and_check(FileSystemReader(path), expected, C.destination_for(expected))


# ------------------------------------------------------------------------------------------------ #
# One process (no_dist).


@pytest.mark.parametrize("id_type", [str, Path])
def test_save_and_load_by_checkpoint_id_go_through_fastdcp(tmp_path, read_data_calls, id_type):
    sd, expected = state(1), C.deepcopy_state_dict(state(1))
    path = tmp_path / "ckpt"
    fastdcp.enable()
    dcp.save(sd, checkpoint_id=id_type(path), no_dist=True)
    assert_written_by("fast", path)

    dest = C.destination_for(expected)
    dcp.load(dest, checkpoint_id=id_type(path), no_dist=True)
    assert read_data_calls == [FastFileSystemReader]
    C.assert_same(dest, expected)
    fastdcp.disable()
    assert_stock_loads(path, expected)


def test_explicit_storage_objects_are_untouched_and_reset_to_checkpoint_id(tmp_path, read_data_calls):
    sd, expected = state(2), C.deepcopy_state_dict(state(2))
    with fastdcp.enable():
        # A stock writer passed explicitly stays stock; checkpoint_id resets it to the new path.
        stock_writer = FileSystemWriter(tmp_path / "unused")
        dcp.save(sd, storage_writer=stock_writer, checkpoint_id=tmp_path / "stock", no_dist=True)
        assert_written_by("stock", tmp_path / "stock")
        # The reset flow with a fastdcp writer: one object, a new checkpoint_id per save.
        writer = FastFileSystemWriter(tmp_path / "first")
        dcp.save(sd, storage_writer=writer, checkpoint_id=tmp_path / "second", no_dist=True)
        assert_written_by("fast", tmp_path / "second")
        assert not (tmp_path / "first").exists() or data_files(tmp_path / "first") == []
        # A stock reader passed explicitly reads (fastdcp's read path never runs).
        dest = C.destination_for(expected)
        dcp.load(dest, storage_reader=FileSystemReader(tmp_path / "second"), no_dist=True)
        assert read_data_calls == []
        C.assert_same(dest, expected)


def test_async_save_by_checkpoint_id_stages_and_writes_with_fastdcp(tmp_path, monkeypatch):
    stagers: list[type] = []
    original_stage = FastFileSystemWriter.stage

    def spy(self, state_dict):
        stagers.append(type(self))
        return original_stage(self, state_dict)

    monkeypatch.setattr(FastFileSystemWriter, "stage", spy)
    sd, expected = state(3), C.deepcopy_state_dict(state(3))
    path = tmp_path / "async"
    with fastdcp.enable():
        future = dcp.async_save(sd, checkpoint_id=str(path), no_dist=True)
        sd["w"].add_(1.0)  # the stage is complete on return: the checkpoint keeps the old values
        future.result()
    assert stagers == [FastFileSystemWriter]
    assert_written_by("fast", path)
    assert_stock_loads(path, expected)


def _accelerate_style_save_and_load(ckpt_dir: Path, sd: dict[str, Any], dest: dict[str, Any]) -> None:
    """Accelerate's ``save_fsdp_model`` / ``load_fsdp_model`` for a sharded state: the storage classes
    looked up on ``torch.distributed.checkpoint`` when called, passed explicitly with stock planners."""
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    dist_cp.save(state_dict={"model": sd}, storage_writer=dist_cp.FileSystemWriter(ckpt_dir),
                 planner=DefaultSavePlanner(), no_dist=True)
    dist_cp.load(state_dict={"model": dest}, storage_reader=dist_cp.FileSystemReader(ckpt_dir),
                 planner=DefaultLoadPlanner(), no_dist=True)


def test_frameworks_that_name_stocks_classes_take_fastdcp_by_replacing_the_names(tmp_path, read_data_calls,
                                                                                 monkeypatch):
    # README "Frameworks": where a framework passes its own FileSystemWriter (Accelerate, Transformers'
    # Trainer through it), enable() changes nothing, and pointing the names at fastdcp's classes does.
    sd, expected = state(5), C.deepcopy_state_dict(state(5))
    with fastdcp.enable():
        dest = C.destination_for(expected)
        _accelerate_style_save_and_load(tmp_path / "as_is", sd, dest)
    assert_written_by("stock", tmp_path / "as_is")
    assert read_data_calls == []

    monkeypatch.setattr(dcp, "FileSystemWriter", FastFileSystemWriter)
    monkeypatch.setattr(dcp, "FileSystemReader", FastFileSystemReader)
    dest = C.destination_for(expected)
    _accelerate_style_save_and_load(tmp_path / "replaced", sd, dest)
    assert_written_by("fast", tmp_path / "replaced")
    assert read_data_calls == [FastFileSystemReader]
    C.assert_same(dest, expected)
    monkeypatch.undo()
    dest = C.destination_for({"model": expected})
    C.load_in_place_and_check(FileSystemReader(tmp_path / "replaced"), {"model": expected}, dest)


def test_disable_restores_stock_exactly(tmp_path):
    fastdcp.enable()
    assert fastdcp.is_enabled()
    assert sorted(_stock_objects_in_place()) == sorted(f"{m.__name__}.{n}" for m, n in STOCK)
    fastdcp.disable()
    assert not fastdcp.is_enabled() and _stock_objects_in_place() == []
    fastdcp.disable()  # twice is fine
    dcp.save(state(4), checkpoint_id=tmp_path / "stock", no_dist=True)
    assert_written_by("stock", tmp_path / "stock")
    dcp.async_save(state(4), checkpoint_id=tmp_path / "stock_async", no_dist=True).result()
    assert_written_by("stock", tmp_path / "stock_async")


def test_context_managers_restore_the_previous_state_and_nest(tmp_path):
    with fastdcp.enable() as outer:
        assert outer.previously_enabled is False
        with fastdcp.enable():  # already on: stays on after the inner block
            pass
        assert fastdcp.is_enabled()
        with fastdcp.disable():
            assert not fastdcp.is_enabled() and _stock_objects_in_place() == []
            dcp.save(state(5), checkpoint_id=tmp_path / "inner", no_dist=True)
            with fastdcp.enable():
                dcp.save(state(5), checkpoint_id=tmp_path / "innermost", no_dist=True)
            assert not fastdcp.is_enabled()
        assert fastdcp.is_enabled()
        dcp.save(state(5), checkpoint_id=tmp_path / "outer", no_dist=True)
    assert not fastdcp.is_enabled() and _stock_objects_in_place() == []
    assert_written_by("stock", tmp_path / "inner")
    assert_written_by("fast", tmp_path / "innermost")
    assert_written_by("fast", tmp_path / "outer")

    with pytest.raises(KeyError):
        with fastdcp.enable():
            raise KeyError("an error inside the block")
    assert not fastdcp.is_enabled() and _stock_objects_in_place() == []


def test_references_copied_while_enabled_act_stock_after_disable(tmp_path, monkeypatch):
    # A torch.distributed.checkpoint module imported while enabled copies the replacement by name.
    late_module = types.ModuleType("torch.distributed.checkpoint._imported_while_enabled")
    monkeypatch.setitem(sys.modules, late_module.__name__, late_module)
    with fastdcp.enable():
        late_module._storage_setup = _storage_utils._storage_setup
        copied_async_save = dcp.async_save  # user code: from torch.distributed.checkpoint import async_save
    assert late_module._storage_setup is STOCK[(_storage_utils, "_storage_setup")]
    copied_async_save(state(6), checkpoint_id=tmp_path / "copied", no_dist=True).result()
    assert_written_by("stock", tmp_path / "copied")


def _outcome(function, *args, **kwargs) -> str:
    try:
        return type(function(*args, **kwargs)).__name__
    except Exception as error:  # the outcome compared, whatever it is
        return f"raises {type(error).__name__}"


@pytest.mark.parametrize("reader", [False, True])
def test_urls_keep_stocks_choice(tmp_path, reader):
    # The decision itself: local paths and s3:// URLs fastdcp, anything else stock sends to fsspec None.
    fast_class = FastFileSystemReader if reader else FastFileSystemWriter
    assert default_storage.fast_storage_class(str(tmp_path / "c"), reader) is fast_class
    assert default_storage.fast_storage_class(tmp_path / "c", reader) is fast_class
    assert default_storage.fast_storage_class("s3://bucket/ckpt", reader) is (FastS3Reader if reader else FastS3Writer)
    for url in ("memory://ckpt", "gs://bucket/ckpt", "file:///tmp/ckpt"):
        assert default_storage.fast_storage_class(url, reader) is None

    # Through DCP's own function: the same outcome as stock for a URL (fsspec's class when
    # fsspec is installed, stock's error when not), fastdcp's class for a path.
    url = "memory://fastdcp-enable-test/ckpt"
    stock_outcome = _outcome(_storage_utils._storage_setup, None, url, reader=reader)
    with fastdcp.enable():
        assert _outcome(_storage_utils._storage_setup, None, url, reader=reader) == stock_outcome
        assert _outcome(_storage_utils._storage_setup, None, tmp_path / "c", reader=reader) == fast_class.__name__
        assert _outcome(_storage_utils._storage_setup, None, None, reader=reader) == "raises RuntimeError"
    try:
        import fsspec  # noqa: F401
    except ImportError:
        return
    assert stock_outcome == ("FsspecReader" if reader else "FsspecWriter")


def test_a_url_checkpoint_round_trips_through_fsspec_while_enabled(read_data_calls):
    fsspec = pytest.importorskip("fsspec")  # an optional dependency; the decision is tested above
    sd, expected = state(7), C.deepcopy_state_dict(state(7))
    url = "memory://fastdcp-enable-test/roundtrip"
    with fastdcp.enable():
        dcp.save(sd, checkpoint_id=url, no_dist=True)
        dest = C.destination_for(expected)
        dcp.load(dest, checkpoint_id=url, no_dist=True)
    names = fsspec.filesystem("memory").ls("/fastdcp-enable-test/roundtrip", detail=False)
    distcp = sorted(Path(n).name for n in names if n.endswith(".distcp"))
    assert distcp and all(STOCK_NAME.fullmatch(n) for n in distcp), distcp
    assert read_data_calls == []
    C.assert_same(dest, expected)


# ------------------------------------------------------------------------------------------------ #
# A torch that moved the hook.


def _wrong_signature(storage, path, is_reader=False):  # parameters renamed
    raise AssertionError("never called")


def _other_function(*args, **kwargs):
    raise AssertionError("never called")


def _async_save_without_checkpoint_id(state_dict, *, storage_writer=None):
    raise AssertionError("never called")


MOVED_HOOKS = {
    "removed": (_storage_utils, "_storage_setup", None,
                "function torch.distributed.checkpoint._storage_utils._storage_setup"),
    "new signature": (_storage_utils, "_storage_setup", _wrong_signature, "_storage_setup with parameters"),
    "saver no longer uses it": (state_dict_saver, "_storage_setup", _other_function,
                                "torch.distributed.checkpoint.state_dict_saver importing"),
    "loader no longer uses it": (state_dict_loader, "_storage_setup", None,
                                 "torch.distributed.checkpoint.state_dict_loader importing"),
    "async_save changed": (state_dict_saver, "async_save", _async_save_without_checkpoint_id,
                           "async_save with parameters"),
}


@pytest.mark.parametrize("case", sorted(MOVED_HOOKS))
def test_a_moved_hook_makes_enable_raise_and_change_nothing(monkeypatch, case):
    module, attribute, replacement, what = MOVED_HOOKS[case]
    if replacement is None:
        monkeypatch.delattr(module, attribute)
    else:
        monkeypatch.setattr(module, attribute, replacement)
    before = {key: getattr(*key, None) for key in STOCK}
    with pytest.raises(HookNotFoundError) as raised:
        fastdcp.enable()
    message = str(raised.value)
    assert f"torch {torch.__version__}" in message and what in message, message
    assert not fastdcp.is_enabled()
    assert {key: getattr(*key, None) for key in STOCK} == before


def test_the_hook_check_sees_the_caller_stop_calling_it(monkeypatch):
    def save_without_storage_setup(state_dict, *, checkpoint_id=None, storage_writer=None):
        return None

    monkeypatch.setattr(state_dict_saver, "save", save_without_storage_setup)
    with pytest.raises(HookNotFoundError, match=r"state_dict_saver\.save calling _storage_setup"):
        fastdcp.enable()


# ------------------------------------------------------------------------------------------------ #
# The environment switch.


def test_environment_switch_values(monkeypatch):
    for off in ("0", "off", ""):
        monkeypatch.setenv("FASTDCP_ENABLE", off)
        default_storage._apply_environment_switch()
        assert not fastdcp.is_enabled()
    monkeypatch.setenv("FASTDCP_ENABLE", "maybe")
    with pytest.raises(ValueError, match="FASTDCP_ENABLE"):
        default_storage._apply_environment_switch()
    monkeypatch.setenv("FASTDCP_ENABLE", "1")
    default_storage._apply_environment_switch()
    assert fastdcp.is_enabled()
    fastdcp.disable()


def test_environment_switch_enables_at_import(tmp_path):
    code = (
        "import torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint import _storage_utils\n"
        "import fastdcp\n"
        f"print(fastdcp.is_enabled(), type(_storage_utils._storage_setup(None, {str(tmp_path / 'c')!r})).__name__)\n"
    )
    env = dict(os.environ, FASTDCP_ENABLE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["True", "FastFileSystemWriter"], done.stdout + done.stderr[-4000:]


# ------------------------------------------------------------------------------------------------ #
# Two processes (gloo): save, load, async_save in thread and process mode, then disable.

WORLD_SIZE = 2
FULL_SHAPE = (10, 24)


def _full(name: str) -> torch.Tensor:
    return C.random_tensor(torch.float32, FULL_SHAPE, ("enable", "mp", name))


def _sharded_state(name: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    return {"w": distribute_tensor(_full(name), mesh, [Shard(0)]), "step": 7}


def _worker(rank: int, root: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # where process-mode async_save starts its TCPStore
    report: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=60))
        read_by: list[str] = []
        original = FastFileSystemReader.read_data

        def spy(self, plan, planner):
            read_by.append(type(self).__name__)
            return original(self, plan, planner)

        FastFileSystemReader.read_data = spy  # this process only
        with fastdcp.enable():
            dcp.save(_sharded_state("sync"), checkpoint_id=f"{root}/sync")
            loaded = _sharded_state("zeros")
            loaded["w"].to_local().zero_()
            dcp.load(loaded, checkpoint_id=f"{root}/sync")
            # Random bits include NaNs: compare bit patterns.
            report["load_exact"] = bool(torch.equal(C.bit_view(loaded["w"].full_tensor()), C.bit_view(_full("sync"))))
            report["read_by"] = read_by
            dcp.async_save(_sharded_state("thread"), checkpoint_id=f"{root}/thread").result()
            dcp.async_save(_sharded_state("process"), checkpoint_id=f"{root}/process",
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        dcp.save(_sharded_state("stock"), checkpoint_id=f"{root}/stock")
        report["ok"] = True
    except BaseException:
        report["error"] = traceback.format_exc()
    finally:
        Path(root, f"report{rank}.json").write_text(json.dumps(report))
    exit_spawned_rank()  # the report carries the verdict


@pytest.mark.fastdcp_timeout(240)
def test_two_processes_gloo(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path),), nprocs=WORLD_SIZE, start_method="spawn", join=True)
    reports = [json.loads((tmp_path / f"report{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for report in reports:
        assert report.get("ok"), report.get("error")
        assert report["load_exact"] and report["read_by"] == ["FastFileSystemReader"], report
    for name, kind in (("sync", "fast"), ("thread", "fast"), ("process", "fast"), ("stock", "stock")):
        assert_written_by(kind, tmp_path / name)
        ranks = {int(pattern.fullmatch(n).group(1)) for n in data_files(tmp_path / name)
                 for pattern in (FAST_NAME if kind == "fast" else STOCK_NAME,)}
        assert ranks == set(range(WORLD_SIZE)), (name, data_files(tmp_path / name))
        full = {"w": _full(name), "step": 7}
        assert_stock_loads(tmp_path / name, full)
