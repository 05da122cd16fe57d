"""Fixtures of the benchmark tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture
def fake_fio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    """``install(script)``: put an executable ``fio`` first on PATH, the Python ``script`` (a
    template with ``{python}`` for the interpreter line), and return an empty data directory for
    the probe to write into."""

    def install(script: str) -> Path:
        bindir = tmp_path / "bin"
        bindir.mkdir()
        fio = bindir / "fio"
        fio.write_text(script.format(python=sys.executable))
        fio.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
        data = tmp_path / "data"
        data.mkdir()
        return data

    return install
