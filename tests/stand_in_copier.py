"""A stand-in for the CUDA copier of the GPU save paths (the pinned ring, staging's device copies)
on machines without a GPU: CPU tensors play device tensors, and each device-to-host copy lands
only when it is waited for, its destination poisoned until then (as an asynchronous copy is late),
so code that reads a destination before waiting for its copy reads 0xEE bytes."""

from __future__ import annotations

import pytest
import torch


class DeferredCopier:
    """Copies happen only when waited for; every slot byte is poisoned when it is handed out."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.tokens = 0
        self.copies = 0
        self.ordered = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.fill_(0xEE)  # what the slot holds until the "transfer" lands
        self.pending.append((self.tokens, dst, src))

    def copy_many(self, pairs) -> None:
        for dst, src in pairs:
            self.copy(dst, src)

    def record(self) -> int:
        self.tokens += 1
        return self.tokens - 1

    def order_current_streams_after(self) -> None:
        """What the CUDA copier does for guarded device buffers (the current streams wait for the
        copies so far); counted here."""
        self.ordered += 1

    def wait(self, token: int) -> None:
        still = []
        for t, dst, src in self.pending:
            if t <= token:
                dst.copy_(src)
                self.copies += 1
            else:
                still.append((t, dst, src))
        self.pending = still


@pytest.fixture
def cpu_as_device(monkeypatch):
    """Route every CPU tensor of a fastdcp save (local or object storage) through the pinned ring,
    with a :class:`DeferredCopier` per ring; the copiers made, for the test to inspect."""
    import fastdcp.save.file_sink as sink_module
    import fastdcp.save.writer as writer_module

    copiers: list[DeferredCopier] = []

    def make():
        copiers.append(DeferredCopier())
        return copiers[-1]

    monkeypatch.setattr(writer_module, "_stays_on_device", lambda t: True)
    monkeypatch.setattr(sink_module, "make_copier", make)
    return copiers
