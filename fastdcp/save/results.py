"""The write results a rank sends to the coordinator after writing its data files.

:func:`pack_write_results` is what ``FastFileSystemWriter.write_data`` returns: the list of
``WriteResult`` DCP gathers on the coordinator for ``finish``.
"""

from __future__ import annotations

from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["pack_write_results"]


def pack_write_results(plan: SavePlan, results: list[WriteResult]) -> list[WriteResult]:
    """The results of writing ``plan``'s items, in the form they travel to the coordinator
    (``results`` holds one ``WriteResult`` per item of ``plan``, in any order)."""
    return results
