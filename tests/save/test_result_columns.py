"""fastdcp.save.results.storage_columns: every rank's write results, sent as columns, placed
into the checkpoint table's storage columns by table row."""

from __future__ import annotations

import pytest
import torch

from fastdcp.format.chunk_table import NO_CHECKSUM, tensor_bytes
from fastdcp.save.results import ResultColumns, storage_columns


def _columns(files, rows, file_index, byte_offset, byte_length, checksums) -> ResultColumns:
    as_bytes = lambda values: tensor_bytes(torch.tensor(values, dtype=torch.int64))  # noqa: E731
    return ResultColumns(tuple(files), as_bytes(rows), as_bytes(file_index), as_bytes(byte_offset),
                         as_bytes(byte_length), as_bytes(checksums))


def test_results_of_every_rank_land_on_their_rows():
    per_rank = [
        _columns(["__0_0.distcp"], [3, 0], [0, 0], [0, 100], [100, 7], [11, NO_CHECKSUM]),
        _columns([], [], [], [], [], []),  # a rank that wrote nothing
        _columns(["__2_0.distcp", "__2_1.distcp"], [1, 4, 2], [1, 0, 1], [0, 0, 64], [64, 5, 9], [1, 2, 3]),
    ]
    storage = storage_columns(5, per_rank)
    assert storage.files == ["__0_0.distcp", "__2_0.distcp", "__2_1.distcp"]
    assert storage.file_index.tolist() == [0, 2, 2, 0, 1]
    assert storage.byte_offset.tolist() == [100, 0, 64, 0, 0]
    assert storage.byte_length.tolist() == [7, 64, 9, 100, 5]
    assert storage.checksums.tolist() == [NO_CHECKSUM, 1, 3, 11, 2]


def test_a_row_without_a_result_or_with_two_is_refused():
    with pytest.raises(ValueError, match="1 without a result, 0 with several"):
        storage_columns(3, [_columns(["f"], [0, 2], [0, 0], [0, 1], [1, 1], [0, 0])])
    with pytest.raises(ValueError, match="1 with several"):
        storage_columns(2, [_columns(["f"], [0, 1], [0, 0], [0, 1], [1, 1], [0, 0]),
                            _columns(["g"], [1], [0], [0], [1], [0])])


def test_columns_of_different_lengths_are_refused_naming_the_rank():
    good = _columns(["f"], [0], [0], [0], [1], [0])
    bad = _columns(["g"], [1, 2], [0, 0], [0], [1, 1], [0, 0])
    with pytest.raises(ValueError, match="rank 1's write results have columns of different lengths"):
        storage_columns(3, [good, bad])
