"""Stock's ``DefaultStager`` used again after its first stage, on the releases where it breaks.

torch 2.11 and 2.12 close the stager's ``StateDictStager`` at the end of every ``DefaultStager``
stage (to break a reference cycle), and a closed ``StateDictStager`` has lost its copy dispatch
table: the next stage of the same ``DefaultStager`` fails with ``KeyError: <class 'type'>``
(pytorch/pytorch#183413, fixed in 2.13, which closes it only in ``DefaultStager.close``). Jobs
that keep one stager and pass it to every ``dcp.async_save(..., async_stager=stager)`` (torchtitan's
``async_with_pinned_mem`` mode) fail on their second checkpoint.

:func:`mend_default_stager` (called by ``fastdcp.enable()`` and by every ``FastFileSystemWriter``)
finds out whether this torch has the bug by asking stock's own classes (two CPU stages of a
one-element state; nothing is guessed from the version) and, where it does, wraps
``DefaultStager._stage`` so that a stage that finds its ``StateDictStager`` closed gives it a new
one with the same options first. The closed one had already dropped its cached storages, so this
costs nothing that the release's own behaviour kept; stock's close after each stage stays.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any

import torch

__all__ = ["default_stager_breaks_on_reuse", "mend_default_stager"]

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "broken": the probe's answer; "mended": whether the wrapper is in


def _probe() -> bool:
    """Whether a ``DefaultStager`` of this torch fails its second stage (see the module docstring)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # no DefaultStager: nothing to mend
        return False
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1), "step": 1})
    except KeyError:
        return True
    finally:
        stager.close()
    return False


def default_stager_breaks_on_reuse() -> bool:
    """Whether this torch's ``DefaultStager`` fails its second stage unmended (asked once, of the
    unmended class)."""
    with _lock:
        if "broken" not in _state:
            _state["broken"] = _probe()
        return _state["broken"]


def mend_default_stager() -> bool:
    """Make stock's ``DefaultStager`` usable for more than one stage on this torch (see the module
    docstring). Idempotent; returns whether a mend is in place. A torch whose stager works as it
    is is left alone."""
    if not default_stager_breaks_on_reuse():
        return False
    with _lock:
        if _state.get("mended"):
            return True
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager
        from torch.distributed.checkpoint.staging import DefaultStager

        original = DefaultStager._stage

        @functools.wraps(original)
        def _stage(self, state_dict, **kwargs):
            inner = getattr(self, "_state_dict_stager", None)
            if isinstance(inner, StateDictStager) and not getattr(inner, "_deepcopy_dispatch", True):
                # closed by this stager's previous stage: the same options, a working table
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the pin_memory-without-CUDA note, said once already
                    self._state_dict_stager = StateDictStager(
                        pin_memory=inner.pin_memory, share_memory=inner.share_memory,
                        **({"pin_memory_min_bytes": inner.pin_memory_min_bytes}
                           if hasattr(inner, "pin_memory_min_bytes") else {}),
                    )
            return original(self, state_dict, **kwargs)

        _stage.__fastdcp_mend__ = original  # type: ignore[attr-defined]
        DefaultStager._stage = _stage
        _state["mended"] = True
        return True
