"""The device branch of ``dcp.async_save`` staging on a machine without a GPU: CPU tensors stand in
for GPU tensors, and a stand-in copier plays the side stream's device-to-host copies, deferring
each copy until it is waited for (as an asynchronous copy lands late) and poisoning its
destination meanwhile. A stage that returned, or completed, before waiting for its device copies
shows up as poisoned bytes in the staged copy or the checkpoint. Each test runs with staging
memory unpinned and in fake-pinned mode (pinned as under CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
import fastdcp
import fastdcp.save.staging as staging_module
from fastdcp import FastFileSystemWriter
from stand_in_copier import DeferredCopier

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(params=[False, True], ids=["unpinned", "fake-pinned"])
def pinned(request, monkeypatch):
    if request.param:
        monkeypatch.setenv("FASTDCP_TEST_FAKE_PINNED", "1")
    else:  # whatever the suite runs under
        monkeypatch.delenv("FASTDCP_TEST_FAKE_PINNED", raising=False)
    yield request.param
    fastdcp.release_staging()  # no slab of this mode is left for later tests


@pytest.fixture
def device_tensors(monkeypatch):
    """Mark CPU tensors as device tensors (by storage); returns (mark, copiers)."""
    marked: set[int] = set()
    copiers: list[DeferredCopier] = []

    def new_copier():
        copiers.append(DeferredCopier())
        return copiers[-1]

    monkeypatch.setattr(staging_module, "_is_device_source",
                        lambda t: t.untyped_storage().data_ptr() in marked)
    monkeypatch.setattr(staging_module, "_new_copier", new_copier)

    def mark(*tensors: torch.Tensor) -> None:
        marked.update(t.untyped_storage().data_ptr() for t in tensors)

    return mark, copiers


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "dev_w": torch.randn(97, 61, generator=g),
        "dev_b": torch.randn(3, 4099, generator=g).bfloat16(),
        "dev_i": torch.randint(-1000, 1000, (12345,), generator=g, dtype=torch.int64),
        "host_w": torch.randn(50, 7, generator=g),
        "step": seed,
    }


def test_a_blocking_stage_returns_after_its_device_copies(tmp_path, pinned, device_tensors):
    mark, copiers = device_tensors
    sd = _state(1)
    expected = C.deepcopy_state_dict(sd)
    mark(sd["dev_w"], sd["dev_b"], sd["dev_i"])
    writer = FastFileSystemWriter(tmp_path)
    staged = writer.stage(sd)
    assert len(copiers) == 1 and copiers[0].copies == 3 and not copiers[0].pending
    for key in ("dev_w", "dev_b", "dev_i", "host_w"):
        C.assert_tensor_bitexact(staged[key], expected[key], key)
        assert staged[key].is_pinned() is pinned, key
    assert writer._stager._slab.pinned is pinned


@pytest.mark.parametrize("budget", [None, 30_000], ids=["whole", "budget"])
def test_overlapped_staging_completes_after_its_device_copies(tmp_path, pinned, device_tensors, budget):
    """dcp.async_save with async_staging=True: the checkpoint holds the state of the call, the
    device copies waited for before the stage completes (with a budget: the tensors beyond it
    written from live memory before it completes)."""
    mark, copiers = device_tensors
    writer = FastFileSystemWriter(tmp_path / "w", async_staging=True, snapshot_limit_bytes=budget)
    for step in range(2):
        sd = _state(10 + step)
        expected = C.deepcopy_state_dict(sd)
        mark(sd["dev_w"], sd["dev_b"], sd["dev_i"])
        path = tmp_path / f"ckpt{step}"
        response = dcp.async_save(sd, storage_writer=writer, checkpoint_id=path, no_dist=True)
        response.staging_completion.result()
        for key in ("dev_w", "dev_b", "dev_i", "host_w"):
            sd[key].fill_(0)
        response.upload_completion.result()
        assert copiers and not copiers[-1].pending
        C.load_in_place_and_check(dcp.FileSystemReader(path), expected, C.destination_for(expected))
    report = writer._stager.last_report
    assert (report.streamed_bytes > 0) == (budget is not None), report
