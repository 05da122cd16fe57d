"""Tiered checkpoints on real mounts: the local tier on /dev/shm (tmpfs), the shared tier a
directory on the disk (pytest's tmp_path) or an S3 prefix on the test server. Each test checks
what a user watches: the save returns at the local commit, the checkpoint becomes durable in the
shared tier, stock's readers load every copy bit-exact, local copies stay within their budget, and
every failure is named and loses nothing."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

import dcp_cases as C
from fastdcp import FastTieredReader, FastTieredWriter, S3Options, TieredDrainError, TieredDrainWarning
from fastdcp.tiered import local_tier
from fastdcp.tiered.drain import LocalCommit, commit_when_drained
from fastdcp.tiered.shared_tier import DirectoryTier

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def local_root():
    """A local tier of this test's own on /dev/shm."""
    root = Path("/dev/shm") / f"fastdcp-test-{uuid.uuid4().hex[:10]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _state(seed: int, mib: float = 1.0) -> dict:
    n = int(mib * (1 << 20)) // 4
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n // 2, generator=g).reshape(-1, 64), "b": torch.randn(n // 2, generator=g).bfloat16(),
            "scalar": torch.tensor(float(seed)), "step": seed}


def _zeros_like(state: dict) -> dict:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in state.items()}


def _stock_load(path, like: dict) -> dict:
    dest = _zeros_like(like)
    dcp.load(dest, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return dest


def _tiered_load(shared, local_root, like: dict) -> tuple[dict, str]:
    dest = _zeros_like(like)
    reader = FastTieredReader(shared, local_root=local_root)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    return dest, reader.tier


def test_a_save_returns_at_the_local_commit_then_becomes_durable_in_the_shared_directory(tmp_path, local_root):
    shared = tmp_path / "run" / "step1"
    state = _state(1)
    writer = FastTieredWriter(shared, local_root=local_root)
    dcp.save(state, storage_writer=writer, no_dist=True)
    local = Path(writer.local_path)
    assert local.parent == local_root and (local / ".metadata").is_file()
    writer.wait_durable(60)
    assert (shared / ".metadata").is_file() and (local / ".durable").is_file()
    C.assert_same(_stock_load(shared, state), state)  # the shared copy, by stock's reader
    C.assert_same(_stock_load(local, state), state)   # and the local one
    loaded, tier = _tiered_load(shared, local_root, state)
    assert tier == "local"
    C.assert_same(loaded, state)


def test_the_reader_falls_back_to_the_shared_tier_when_the_local_copy_is_gone_or_partial(tmp_path, local_root):
    shared = tmp_path / "step2"
    state = _state(2)
    writer = FastTieredWriter(shared, local_root=local_root)
    dcp.save(state, storage_writer=writer, no_dist=True)
    writer.wait_durable(60)
    (data,) = [p for p in Path(writer.local_path).iterdir() if p.suffix == ".distcp"]
    data.unlink()  # partial locally (another node's files, a cleaned disk)
    loaded, tier = _tiered_load(shared, local_root, state)
    assert tier == "shared"
    C.assert_same(loaded, state)
    shutil.rmtree(writer.local_path)  # a restart on another node
    loaded, tier = _tiered_load(shared, local_root, state)
    assert tier == "shared"
    C.assert_same(loaded, state)


def test_async_saves_every_step_keep_the_state_at_the_call_and_the_local_budget(tmp_path, local_root):
    writer = FastTieredWriter(tmp_path / "ckpt" / "0", local_root=local_root, keep_local=2, async_staging=True)
    expected = []
    for step in range(5):
        state = _state(10 + step)
        expected.append(C.deepcopy_state_dict(state))
        result = dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / "ckpt" / str(step), no_dist=True)
        staged = getattr(result, "staging_completion", None)
        if staged is not None:
            staged.result()
        state["w"].add_(1)  # training goes on
        getattr(result, "upload_completion", result).result()  # committed locally
        assert (Path(writer.local_path) / ".metadata").is_file()
        writer.wait_durable(60)
    for step, state in enumerate(expected):
        C.assert_same(_stock_load(tmp_path / "ckpt" / str(step), state), state)
    kept = sorted(os.listdir(local_root))
    assert len(kept) == 2 and kept == sorted(os.path.basename(local_tier.local_directory(
        str(local_root), str(tmp_path / "ckpt" / str(s)))) for s in (3, 4)), kept


def test_only_durable_local_copies_are_evicted(tmp_path):
    root = tmp_path / "local"
    for i, markers in enumerate([[".durable"], [], [".drained.rank1"], [".drained.rank1", ".drained.rank2"]]):
        d = root / f"c{i}"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"x") if i < 2 else None
        for rank in (1, 2) if i >= 2 else ():
            (d / f"__{rank}_abcd_0.distcp").write_bytes(b"x")
        for m in markers:
            (d / m).write_bytes(b"")
        for f in d.iterdir():  # written in order c0 .. c3; markers (written late) do not count
            os.utime(f, (i, i) if not f.name.startswith(".d") else (100, 100))
    removed = local_tier.evict(str(root), keep=0)
    # c0: committed in the shared tier; c3: every rank's files drained (a node without .metadata);
    # c1 (never durable) and c2 (rank 2 not drained) stay: they may be the only copies.
    assert sorted(os.path.basename(p) for p in removed) == ["c0", "c3"]
    assert sorted(os.listdir(root)) == ["c1", "c2"]


@pytest.fixture
def small_tmpfs(tmp_path, request):
    """A 4 MiB tmpfs at tmp_path/mnt: a full tier, for real."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs (CI runs as root)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr}")
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(mnt)], capture_output=True))
    return mnt


def test_a_full_shared_tier_fails_the_drain_naming_the_file_and_loses_nothing(small_tmpfs, local_root):
    old = _state(3, 1.0)
    writer = FastTieredWriter(small_tmpfs / "step1", local_root=local_root)
    dcp.save(old, storage_writer=writer, no_dist=True)
    writer.wait_durable(60)
    big = _state(4, 8.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save(big, storage_writer=writer, checkpoint_id=small_tmpfs / "step2", no_dist=True)  # commits locally
        with pytest.raises(TieredDrainError, match=r"cannot copy rank 0's files \(__0_[0-9a-f]+_\d+\.distcp.*\) from "
                                                   rf"'{local_root}/.*' to '{small_tmpfs}/step2'.*No space left on device"):
            writer.wait_durable(60)
    assert any(issubclass(w.category, TieredDrainWarning) and "No space left" in str(w.message) for w in caught)
    assert not (small_tmpfs / "step2" / ".metadata").exists()
    assert not [n for n in os.listdir(small_tmpfs / "step2") if n.endswith(".part")]
    C.assert_same(_stock_load(small_tmpfs / "step1", old), old)  # the last durable checkpoint
    loaded, tier = _tiered_load(small_tmpfs / "step2", local_root, big)  # the new one, from the local tier
    assert tier == "local"
    C.assert_same(loaded, big)


def test_a_full_local_tier_is_a_clear_error_and_the_shared_checkpoint_stays(tmp_path, small_tmpfs):
    old = _state(5, 1.0)
    writer = FastTieredWriter(tmp_path / "step1", local_root=small_tmpfs)
    dcp.save(old, storage_writer=writer, no_dist=True)
    writer.wait_durable(60)
    with pytest.raises(CheckpointException, match=rf"(?s)No space left on device.*{small_tmpfs}|{small_tmpfs}.*No space left"):
        dcp.save(_state(6, 8.0), storage_writer=writer, checkpoint_id=tmp_path / "step2", no_dist=True)
    assert not (tmp_path / "step2" / ".metadata").exists()
    C.assert_same(_stock_load(tmp_path / "step1", old), old)


def test_the_coordinator_names_the_files_that_never_arrived_at_its_deadline(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    commit = LocalCommit(str(local), ".metadata", b"not used", (), frozenset({"__1_abcd_0.distcp"}), "abcd",
                         frozenset({1}))
    future = commit_when_drained(DirectoryTier(tmp_path / "shared"), commit, None, 0.3, str(tmp_path / "root"), 2)
    with pytest.warns(TieredDrainWarning), pytest.raises(TieredDrainError, match=r"after 0.3 s.*never arrived.*__1_abcd_0\.distcp"):
        future.result(30)
    assert not (tmp_path / "shared" / ".metadata").exists()


def test_sigkill_during_the_drain_leaves_the_last_durable_checkpoint_and_a_whole_local_copy(tmp_path, local_root):
    shared = tmp_path / "run"
    old = _state(7)
    writer = FastTieredWriter(shared / "step1", local_root=local_root)
    dcp.save(old, storage_writer=writer, no_dist=True)
    writer.wait_durable(60)
    notes = tmp_path / "notes"
    code = textwrap.dedent(f"""
        import sys, torch, torch.distributed.checkpoint as dcp
        sys.path[:0] = [{str(REPO / "tests")!r}, {str(REPO)!r}]
        from test_tiered_checkpoints import _state
        from fastdcp import FastTieredWriter
        writer = FastTieredWriter({str(shared / "step2")!r}, local_root={str(local_root)!r})
        dcp.save(_state(8), storage_writer=writer, no_dist=True)
        open({str(notes)!r}, "a").write("committed locally\\n")
        writer.wait_durable(600)
    """)
    env = dict(os.environ, FASTDCP_TEST_PAUSE_AT="drain", FASTDCP_TEST_PAUSE_S="120",
               FASTDCP_TEST_PAUSE_NOTIFY=str(notes), PYTHONPATH=str(REPO / "tests" / "tiered"))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = notes.read_text() if notes.exists() else ""
        if "drain " in text and "committed locally" in text:
            break
        if proc.poll() is not None:
            pytest.fail(f"the saving process ended early: {proc.stderr.read()[-3000:]}")
        time.sleep(0.01)
    else:
        proc.kill()
        pytest.fail(f"the drain never started: {notes.read_text() if notes.exists() else ''}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert not (shared / "step2" / ".metadata").exists()  # never committed in the shared tier
    C.assert_same(_stock_load(shared / "step1", old), old)
    loaded, tier = _tiered_load(shared / "step2", local_root, _state(8))  # the restarted job resumes locally
    assert tier == "local"
    C.assert_same(loaded, _state(8))


def _two_rank_main(rank: int, store: str, shared: str, local_root: str, fail_rank: int | None) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from fastdcp.tiered import shared_tier

    if rank == fail_rank:
        def refuse(tier, files):
            raise OSError(errno.EDQUOT, f"Disk quota exceeded: '{os.path.join(tier.path, files[0][1])}'")

        shared_tier.put_files = refuse
    with C.gloo_rank_mesh(rank, store, 2) as mesh:
        full = _state(20, 2.0)
        state = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "b": full["b"], "step": 20}
        writer = FastTieredWriter(shared, local_root=local_root)
        dcp.save(state, storage_writer=writer)
        if fail_rank is None:
            writer.wait_durable(120)
            return
        with pytest.raises(TieredDrainError) as info:
            writer.wait_durable(120)
        # each rank fails: rank 1 on its copy, the coordinator at once (not at its deadline), naming
        # the rank whose copy failed and why
        assert "Disk quota exceeded" in str(info.value) and (rank == 1 or "rank 1" in str(info.value)), str(info.value)


@pytest.mark.parametrize("fail_rank", [None, 1], ids=["both-drain", "rank1-fails"])
def test_two_ranks_drain_their_own_files_and_the_coordinator_commits_once_all_arrived(tmp_path, local_root, fail_rank):
    shared = tmp_path / "shared" / "step20"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.spawn(_two_rank_main, args=(str(tmp_path / "pg"), str(shared), str(local_root), fail_rank), nprocs=2, join=True)
    full = {k: v for k, v in _state(20, 2.0).items() if k in ("w", "b")}
    full["step"] = 20
    if fail_rank is None:
        assert sorted(n for n in os.listdir(shared) if n.endswith(".distcp")) == sorted(
            n for n in os.listdir(local_tier.local_directory(str(local_root), str(shared))) if n.endswith(".distcp"))
        C.assert_same(_stock_load(shared, full), full)
    else:
        assert not (shared / ".metadata").exists()
        loaded, tier = _tiered_load(shared, local_root, full)
        assert tier == "local"
        C.assert_same(loaded, full)


def test_a_tiered_checkpoint_in_s3_loads_with_stock_fsspec_and_from_either_tier(bucket, s3_env, local_root):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    url = f"s3://{bucket}/run/step1"
    state = _state(30)
    writer = FastTieredWriter(url, local_root=local_root)
    dcp.save(state, storage_writer=writer, no_dist=True)
    writer.wait_durable(60)
    dest = _zeros_like(state)
    dcp.load(dest, storage_reader=FsspecReader(url, endpoint_url=s3_env.endpoint), no_dist=True)
    C.assert_same(dest, state)
    loaded, tier = _tiered_load(url, local_root, state)
    assert tier == "local"
    C.assert_same(loaded, state)
    shutil.rmtree(writer.local_path)
    loaded, tier = _tiered_load(url, local_root, state)
    assert tier == "shared"
    C.assert_same(loaded, state)


def test_an_unreachable_s3_shared_tier_fails_the_drain_naming_the_object(bucket, s3_env, local_root):
    url = f"s3://{bucket}/run"
    old = _state(31)
    writer = FastTieredWriter(f"{url}/step1", local_root=local_root,
                              s3_options=S3Options(max_retries=1, retry_timeout_s=2.0, connect_timeout_s=2.0))
    dcp.save(old, storage_writer=writer, no_dist=True)
    writer.wait_durable(60)
    s3_env.kill_proxy()
    try:
        new = _state(32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcp.save(new, storage_writer=writer, checkpoint_id=f"{url}/step2", no_dist=True)
            with pytest.raises(TieredDrainError, match=rf"s3://{bucket}/run/step2/"):
                writer.wait_durable(120)
        assert any(issubclass(w.category, TieredDrainWarning) for w in caught)
    finally:
        s3_env.start_proxy(s3_env.proxy_port)
    loaded, tier = _tiered_load(f"{url}/step2", local_root, new)
    assert tier == "local"
    C.assert_same(loaded, new)
    shutil.rmtree(local_root)
    loaded, tier = _tiered_load(f"{url}/step1", local_root, old)  # the last durable one, from S3
    assert tier == "shared"
    C.assert_same(loaded, old)


def test_process_mode_async_saves_drain_from_dcps_checkpoint_process(tmp_path, local_root):
    """dcp.async_save in process mode: the writer travels to DCP's checkpoint process, which commits
    locally and drains; the trainer sees the local commit, and the shared commit appears."""
    shared = tmp_path / "run"
    code = textwrap.dedent(f"""
        import datetime, sys, time, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        sys.path[:0] = [{str(REPO / "tests" / "tiered")!r}, {str(REPO / "tests")!r}, {str(REPO)!r}]
        from test_tiered_checkpoints import _state
        from fastdcp import FastTieredWriter
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=120))
        writer = FastTieredWriter({str(shared / "step0")!r}, local_root={str(local_root)!r}, async_staging=True)
        for step in range(2):
            state = _state(40 + step)
            result = dcp.async_save(state, storage_writer=writer, checkpoint_id={str(shared)!r} + f"/step{{step}}",
                                    async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            staged = getattr(result, "staging_completion", None)
            if staged is not None:
                staged.result()  # what fastdcp.guard waits for before the optimizer step
            state["w"].add_(1)
            getattr(result, "upload_completion", result).result()
        deadline = time.monotonic() + 120
        import os
        while not all(os.path.exists({str(shared)!r} + f"/step{{s}}/.metadata") for s in range(2)):
            assert time.monotonic() < deadline, "the shared commits never appeared"
            time.sleep(0.05)
        print("DRAINED", flush=True)
        dist.destroy_process_group()
        import os as _os; _os._exit(0)  # DCP's checkpoint process is torn down with the interpreter
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, MASTER_ADDR="127.0.0.1"),
                          capture_output=True, text=True, timeout=300)
    assert "DRAINED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-5000:]
    for step in range(2):
        C.assert_same(_stock_load(shared / f"step{step}", _state(40 + step)), _state(40 + step))


def test_durable_is_never_a_previous_saves(tmp_path, local_root):
    writer = FastTieredWriter(tmp_path / "a", local_root=local_root)
    with pytest.raises(RuntimeError, match="no tiered save has been committed locally"):
        writer.wait_durable(1)
    dcp.save(_state(50), storage_writer=writer, no_dist=True)
    first = writer.durable
    assert first is not None
    writer.wait_durable(60)
    writer.stage(_state(51))  # the next async_save starts staging: the first save's future is gone
    assert writer.durable is None
    writer._release_staging()
    dcp.save(_state(52), storage_writer=writer, checkpoint_id=tmp_path / "b", no_dist=True)
    assert writer.durable is not None and writer.durable is not first
    writer.wait_durable(60)
    C.assert_same(_stock_load(tmp_path / "b", _state(52)), _state(52))


def test_staged_saves_write_the_shared_tier_from_the_slab_and_keep_it_until_done(tmp_path, local_root, monkeypatch):
    """async_save with staging writes the shared copy from the staged slab while the local copy is
    written (not read back from the local tier), and the slab is not refilled by the next save
    before that write is done: four saves in a row, each drain held back, every shared copy exact."""
    from fastdcp.tiered import shared_tier

    def no_read_back(tier, files):
        raise AssertionError("a staged save read its local files back")

    monkeypatch.setattr(shared_tier, "put_files", no_read_back)
    monkeypatch.setenv("FASTDCP_TEST_PAUSE_AT", "drain")
    monkeypatch.setenv("FASTDCP_TEST_PAUSE_S", "0.4")  # each drain starts late: the next save stages meanwhile
    writer = FastTieredWriter(tmp_path / "0", local_root=local_root, keep_local=4, async_staging=True)
    expected, durables = [], []
    state = _state(60, 2.0)
    for step in range(4):
        expected.append(C.deepcopy_state_dict(state))
        result = dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / str(step), no_dist=True)
        result.staging_completion.result()
        state["w"].add_(1)
        state["b"].add_(1)
        result.upload_completion.result()  # committed locally; the shared copy is still being written
        durables.append(writer.durable)
    for step, future in enumerate(durables):
        future.result(60)
        C.assert_same(_stock_load(tmp_path / str(step), expected[step]), expected[step])


def test_a_sync_save_drains_from_the_local_copy(tmp_path, local_root, monkeypatch):
    """dcp.save reads live tensors, which training changes once it returns: the shared copy is
    made from the committed local files."""
    from fastdcp.tiered import shared_tier

    def no_live_images(self, images):
        raise AssertionError("a sync save wrote the shared tier from live memory")

    monkeypatch.setattr(shared_tier.DirectoryTier, "put_images", no_live_images)
    monkeypatch.setattr(shared_tier, "put_files", _put_files_via_copy)
    state = _state(61)
    writer = FastTieredWriter(tmp_path / "s", local_root=local_root)
    dcp.save(state, storage_writer=writer, no_dist=True)
    writer.wait_durable(60)
    C.assert_same(_stock_load(tmp_path / "s", state), state)


def _put_files_via_copy(tier, files):
    """shared_tier.put_files without put_images (which the test above refuses)."""
    os.makedirs(tier.path, exist_ok=True)
    for local, name in files:
        shutil.copyfile(local, os.path.join(tier.path, name))
