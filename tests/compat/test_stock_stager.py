"""Stock's DefaultStager passed to every dcp.async_save, one stager for the whole job (torchtitan's
async_with_pinned_mem mode), with fastdcp's writer and with fastdcp.enable(): every save works on
every supported torch. torch 2.11 and 2.12 break that stager on its second stage
(pytorch/pytorch#183413); fastdcp mends it there (fastdcp.compat.stock_stager)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cases as C
import fastdcp
from fastdcp import FastFileSystemWriter
from fastdcp.compat import stock_stager

staging = pytest.importorskip("torch.distributed.checkpoint.staging")  # torch >= 2.9 has it

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(step: int) -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32) + step, "b": torch.full((7, 3), step, dtype=torch.int64),
            "step": step}


def _stager():
    # pinned memory is ignored with a warning without CUDA; non-blocking copies need an accelerator
    return staging.DefaultStager(staging.StagingOptions(True, True, True, torch.cuda.is_available()))


def _wait(response):
    getattr(response, "upload_completion", response).result()


@pytest.mark.parametrize("how", ["writer", "enable"])
def test_one_stock_stager_for_every_async_save(tmp_path, how):
    stager = _stager()
    restore = fastdcp.enable() if how == "enable" else None
    try:
        for step in range(3):
            path = tmp_path / f"step{step}"
            state = _state(step)
            expected = C.deepcopy_state_dict(state)
            writer = FastFileSystemWriter(path) if how == "writer" else None
            _wait(dcp.async_save(state, checkpoint_id=path, storage_writer=writer, async_stager=stager,
                                 no_dist=True))
            C.load_in_place_and_check(dcp.FileSystemReader(path), expected, C.destination_for(expected))
    finally:
        stager.close()
        if restore is not None:
            fastdcp.disable()


def test_the_mend_is_there_exactly_where_stock_breaks(tmp_path):
    """Asked of stock's unmended class: on 2.11 / 2.12 its second stage fails and the mend is in;
    elsewhere nothing is changed."""
    from torch.distributed.checkpoint.staging import DefaultStager

    FastFileSystemWriter(tmp_path)  # installs the mend where needed
    broken = stock_stager.default_stager_breaks_on_reuse()
    mended = hasattr(DefaultStager._stage, "__fastdcp_mend__")
    assert mended == broken
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if release in ((2, 11), (2, 12)):
        assert broken, f"torch {torch.__version__}: its DefaultStager was expected to break on reuse"
    if release >= (2, 13):
        assert not broken
    if mended:  # the unmended stage, called as stock would: fails on its second use
        unmended = DefaultStager._stage.__fastdcp_mend__
        stager = DefaultStager(staging.StagingOptions(False, False, False, False))
        with pytest.raises(KeyError):
            for _ in range(2):
                unmended(stager, {"t": torch.zeros(2), "n": 1})
