"""What a user reads speaks of the product only: README, docs/, examples/, .ci/ and the package's
source (docstrings, messages, comments) hold no words about how the project is made: numbered
work items and what they asked for, work periods, the machines it was made on.

A measured figure names its machine by what it is ("a 2-core VM, ext4 on virtio"), and a target
is the product's ("the targets"), not a work item's. The check runs on a small sample of each
kind of wording first, so a pattern that cannot fire fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Each pattern names one kind of wording and why a user should not meet it.
FORBIDDEN: dict[str, str] = {
    # a numbered work item, or the work item itself ("the targets", "issue 33")
    "work item": r"\bissues?\s*#?\d+|\b(?:the|this|that|an|our|which|each|every)\s+(?:[\w\"'-]+\s+){0,3}?issue\b"
                 r"|\bissue's\b",
    # a period of work ("a later session", "this session's VM", "the session that found it")
    "work period": r"\b(?:this|that|a later|an earlier|earlier|later|one|the next|the previous|the last|each)"
                   r"\s+sessions?\b|\bsession'?s\s+(?:VM|machine|run|host)\b|\bsession\s+(?:that|which)\b",
    # the machines the project was made on, as such
    "the maker's machine": r"\bdevelopment\s+(?:VM|machine|host|box)\b|\bdev\s+(?:VM|machine|box)\b"
                           r"|\b(?:lent|borrowed)\b",
    # the making itself
    "the making": r"\bwork items?\b|\bthe brief\b|\bsprints?\b|\bsubagents?\b|\bfounding engineers?\b"
                  r"|\b(?:issue|brief|ticket)\s+asked\b",
}
_RX = {kind: re.compile(pattern, re.I) for kind, pattern in FORBIDDEN.items()}

# Wording each pattern must catch, and product wording it must let through.
CAUGHT = {
    "work item": ["Targets of issue 33 in this run", "the issue's 3x over stock_best",
                  "the resume-at-scale issue set its bars", "see issue #12"],
    "work period": ["a later session, whose VM ran", "in this session's run", "the session that found it"],
    "the maker's machine": ["on the 2-core development VM", "no device lent", "a borrowed machine"],
    "the making": ["the issue asked to measure both", "a work item"],
}
ALLOWED = ["AWS_SESSION_TOKEN", "session_token=", "this staging session", "d2h_issue", "issue the copies",
           "def issue(k):", "pytorch/pytorch#190489", "a 2-core VM (ext4 on virtio)", "asked for by the caller"]


def user_facing_files() -> list[Path]:
    """Everything a user reads: the README, docs, examples, CI scripts and the package's source."""
    files = [REPO / "README.md", REPO / "setup.py", REPO / "pyproject.toml"]
    files += sorted((REPO / "docs").glob("*.md"))
    files += sorted(p for p in (REPO / "examples").rglob("*") if p.is_file() and p.suffix in {".py", ".md", ".sh"})
    files += sorted(p for p in (REPO / ".ci").iterdir() if p.is_file())
    files += sorted((REPO / "fastdcp").rglob("*.py"))
    files += sorted(p for p in (REPO / "csrc").rglob("*") if p.suffix in {".h", ".hpp", ".cpp", ".cu", ".cuh"})
    return [p for p in files if p.is_file()]


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, the words) for every forbidden wording in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind, rx in _RX.items():
            found += [(number, kind, m.group(0)) for m in rx.finditer(line)]
    return found


@pytest.mark.parametrize("kind", sorted(FORBIDDEN))
def test_each_pattern_catches_its_wording(kind):
    for sample in CAUGHT[kind]:
        assert any(k == kind for _, k, _ in findings(sample)), f"{kind!r} misses {sample!r}"


def test_product_wording_passes():
    for sample in ALLOWED:
        assert findings(sample) == [], sample


def test_the_scan_covers_what_users_read():
    names = {p.relative_to(REPO).as_posix() for p in user_facing_files()}
    for expected in ("README.md", "docs/performance.md", "docs/gpu.md", "docs/api.md", "examples/README.md",
                     ".ci/run", ".ci/torch-check", "fastdcp/__init__.py", "fastdcp/bench/acceptance.py"):
        assert expected in names, expected


def test_nothing_a_user_reads_speaks_of_how_it_was_made():
    problems = [f"{path.relative_to(REPO)}:{number}: {kind}: {words!r}"
                for path in user_facing_files()
                for number, kind, words in findings(path.read_text(errors="replace"))]
    assert not problems, "wording about how the project is made, not about the product:\n" + "\n".join(problems)
