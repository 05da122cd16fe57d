"""docs/api.md documents the whole public API, as the code has it.

The rules (docs/api.md is a reference: one entry per public name):

- **An entry per name.** Every name in ``fastdcp.__all__``, and ``fastdcp.open``, has either a
  heading ``### `NAME` `` (or ``### `fastdcp.NAME` ``), whose entry runs to the next heading of
  level 1-3, or, for exceptions and warnings, a row of the table under ``## Exceptions and
  warnings`` whose first cell is `` `NAME` ``; that row's second cell names each direct base class.
- **Signatures are the code's.** The entry of each class in ``SIGNED_CLASSES`` and of each public
  function has a ```` ```text ```` block starting ``NAME(``: its parameters, their kinds (positional,
  ``*args``, keyword-only, ``**kwargs``) and their defaults must equal ``inspect.signature``'s
  (``FROM_ENV`` stands for a default read from the environment, the code's sentinel objects).
- **Every argument explained.** Each of those parameters also appears in inline code in the entry's
  prose or tables (the signature block does not count).
- **Every field.** Each field of a dataclass in ``__all__`` appears in inline code in its entry.
- **Every environment variable.** Every ``FASTDCP_*`` variable the package reads (string constants
  in fastdcp/ other than docstrings, ``getenv`` in csrc/, ``os.environ`` in setup.py) is the first
  cell of a table row under ``## Environment variables``, except the test-only hooks listed in
  ``UNDOCUMENTED_TEST_HOOKS`` with why, and the old names of renamed variables, which the
  ``## Renamed`` table lists. Conversely every ``FASTDCP_*`` variable those tables name is read
  somewhere (fastdcp/, csrc/, setup.py, tests/).
- **Renames.** Every old name in ``fastdcp.compat.renamed`` is a row ``| `old` | `new` | where |`` of the
  ``## Renamed`` table, whose third cell names each callable that accepts it.
- **`open` is not exported by `*`.** ``fastdcp.open`` exists, is not in ``__all__``, and
  ``from fastdcp import *`` leaves Python's ``open`` alone.
- **About the product only.** docs/api.md has no words about how the project is developed
  (``FORBIDDEN_WORDING``).

Each check also runs on a small broken sample, so a check that cannot fail fails here.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from test_docs import inline_code, split_fenced

import fastdcp
from fastdcp.compat import renamed as _renamed

REPO = Path(__file__).resolve().parent.parent
API_MD = REPO / "docs" / "api.md"

SIGNED_CLASSES = ("FastFileSystemWriter", "FastFileSystemReader", "FastS3Writer", "FastS3Reader", "FastTieredWriter",
                  "FastTieredReader", "S3Options", "FastSavePlanner", "FastLoadPlanner")

# FASTDCP_* variables read by the package but not documented in docs/api.md, each with why.
UNDOCUMENTED_TEST_HOOKS = {
    "FASTDCP_TEST_FAKE_PINNED": "test suites without a GPU: host slabs behave as pinned (docs/gpu.md, fake-pinned mode)",
    "FASTDCP_TEST_DIRECT_EINVAL": "fault injection in csrc/file.cpp: O_DIRECT refused at open or I/O, for the fallback tests",
    "FASTDCP_TEST_MAX_IO_BYTES": "fault injection in csrc/file.cpp: short reads and writes, for the engine's retry tests",
}

FORBIDDEN_WORDING = (
    r"\bthe session\b", r"\bsessions?\s+(?:that|which)\b", r"\bissue\s*#?\d+", r"\bdevelopment (?:VM|machine)\b",
    r"\blent\b", r"\bborrowed\b", r"\bthis project's\b", r"\bthe helper\b", r"\bthe brief\b",
)


# ---------------------------------------------------------------------------------------------
# Reading the reference
# ---------------------------------------------------------------------------------------------


def entries(text: str) -> dict[str, str]:
    """name -> the text of its ``### `NAME` `` entry (up to the next heading of level 1-3)."""
    lines = text.split("\n")
    prose, _ = split_fenced(text)
    prose_lines = prose.split("\n")  # headings only count outside code blocks
    heads = [(i, m) for i, line in enumerate(prose_lines) if (m := re.match(r"^(#{1,3})\s+(.*?)\s*$", line))]
    out: dict[str, str] = {}
    for k, (i, m) in enumerate(heads):
        end = heads[k + 1][0] if k + 1 < len(heads) else len(lines)
        name = re.fullmatch(r"`(?:fastdcp\.)?([A-Za-z_]\w*)`", m.group(2))
        if len(m.group(1)) == 3 and name:
            out[name.group(1)] = "\n".join(lines[i:end])
    return out


def section(text: str, title: str) -> str:
    """The text under ``## title`` up to the next level-2 heading."""
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    return m.group(1) if m else ""


def table_rows(text: str) -> list[list[str]]:
    """The cells of every table body row in ``text`` (header and delimiter rows left out)."""
    rows = []
    lines = split_fenced(text)[0].split("\n")
    for i, line in enumerate(lines):
        if not line.startswith("|") or re.match(r"^\|[\s:|-]+\|$", line):
            continue
        if i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            continue  # a header row
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def code_words(text: str) -> set[str]:
    """Identifiers inside the inline code of ``text``'s prose (code blocks left out)."""
    prose, _ = split_fenced(text)
    return {w for code in inline_code(prose) for w in re.findall(r"[A-Za-z_]\w*", code)}


def exception_rows(text: str) -> dict[str, list[str]]:
    return {m.group(1): row for row in table_rows(section(text, "Exceptions and warnings"))
            if (m := re.fullmatch(r"`(\w+)`", row[0]))}


# ---------------------------------------------------------------------------------------------
# Signatures
# ---------------------------------------------------------------------------------------------

FROM_ENV = object()  # a documented `FROM_ENV` default


def documented_signature(entry: str, name: str) -> list[tuple[str, str, object]] | None:
    """(name, kind, default) of each parameter of the entry's ```text signature block, or None."""
    for block in re.findall(r"^```text[ \t]*\n(.*?)^```", entry, re.M | re.S):
        stripped = block.strip()
        if stripped.startswith(name + "("):
            tree = ast.parse("def _f" + stripped[len(name):] + ": pass")
            return _parameters(tree.body[0].args)
    return None


def _value(node: ast.expr | None) -> object:
    if node is None:
        return inspect.Parameter.empty
    if isinstance(node, ast.Name) and node.id == "FROM_ENV":
        return FROM_ENV
    return eval(compile(ast.Expression(node), "<default>", "eval"), {"__builtins__": {}}, {})  # noqa: S307 - literals and arithmetic


def _parameters(args: ast.arguments) -> list[tuple[str, str, object]]:
    out: list[tuple[str, str, object]] = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for a, d in zip(positional, defaults):
        kind = "POSITIONAL_ONLY" if a in args.posonlyargs else "POSITIONAL_OR_KEYWORD"
        out.append((a.arg, kind, _value(d)))
    if args.vararg:
        out.append((args.vararg.arg, "VAR_POSITIONAL", inspect.Parameter.empty))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, "KEYWORD_ONLY", _value(d)))
    if args.kwarg:
        out.append((args.kwarg.arg, "VAR_KEYWORD", inspect.Parameter.empty))
    return out


_LITERALS = (type(None), bool, int, float, str, tuple)


def code_signature(obj: object) -> list[tuple[str, str, object]]:
    out = []
    for p in inspect.signature(obj).parameters.values():
        default = p.default
        if default is not inspect.Parameter.empty and not isinstance(default, _LITERALS):
            default = FROM_ENV  # a sentinel: the docs say FROM_ENV
        out.append((p.name, p.kind.name, default))
    return out


def _same_default(a: object, b: object) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def signature_problems(entry: str, name: str, obj: object) -> list[str]:
    documented = documented_signature(entry, name)
    if documented is None:
        return [f"{name}: no ```text block starting {name}( in its entry"]
    code = code_signature(obj)
    problems = []
    if [(n, k) for n, k, _ in documented] != [(n, k) for n, k, _ in code]:
        problems.append(f"{name}: documented parameters {[(n, k) for n, k, _ in documented]} != the code's "
                        f"{[(n, k) for n, k, _ in code]}")
    else:
        for (pname, _, doc_default), (_, _, code_default) in zip(documented, code):
            if not _same_default(doc_default, code_default):
                problems.append(f"{name}({pname}=...): documented default {doc_default!r} != the code's {code_default!r}")
    explained = code_words(entry)
    problems += [f"{name}: argument {p!r} is not explained (inline code) in its entry"
                 for p, _, _ in code if p not in explained]
    return problems


def public_functions() -> dict[str, object]:
    out = {n: getattr(fastdcp, n) for n in fastdcp.__all__
           if inspect.isfunction(getattr(fastdcp, n)) or inspect.isbuiltin(getattr(fastdcp, n))}
    out["open"] = fastdcp.open
    return out


def api_problems(text: str) -> list[str]:
    """Every rule but the environment's, renames' and wording's, checked against ``text``."""
    found = entries(text)
    excs = exception_rows(text)
    problems = []
    for name in list(fastdcp.__all__) + ["open"]:
        obj = getattr(fastdcp, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            row = excs.get(name)
            if row is None:
                problems.append(f"{name}: no row in the table under '## Exceptions and warnings'")
                continue
            bases = set(re.findall(r"`(\w+)`", row[1] if len(row) > 1 else ""))
            problems += [f"{name}: its row does not name its base {b.__name__}" for b in obj.__bases__
                         if b.__name__ not in bases]
            continue
        entry = found.get(name)
        if entry is None:
            problems.append(f"{name}: no '### `{name}`' heading")
            continue
        if name in SIGNED_CLASSES or name in public_functions():
            problems += signature_problems(entry, name, obj)
        if dataclasses.is_dataclass(obj) and name not in SIGNED_CLASSES:
            words = code_words(entry)
            problems += [f"{name}: field {f.name!r} is not in its entry" for f in dataclasses.fields(obj)
                         if f.name not in words]
    return problems


# ---------------------------------------------------------------------------------------------
# Environment variables
# ---------------------------------------------------------------------------------------------

_VAR = re.compile(r"\bFASTDCP_[A-Z0-9_]*[A-Z0-9]\b")


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def variables_in_python(source: str) -> set[str]:
    """FASTDCP_* names in the string constants of ``source`` (docstrings and comments left out)."""
    tree = ast.parse(source)
    docs = _docstring_nodes(tree)
    return {v for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            for v in _VAR.findall(node.value)}


def variables_read() -> set[str]:
    found: set[str] = set()
    for path in (REPO / "fastdcp").rglob("*.py"):
        found |= variables_in_python(path.read_text())
    for path in (REPO / "csrc").rglob("*"):
        if path.suffix in (".cpp", ".h", ".hpp", ".cu", ".cuh"):
            found |= set(re.findall(r'getenv\(\s*"(FASTDCP_\w+)"', path.read_text()))
    found |= set(re.findall(r'environ(?:\.get)?[\[(]\s*"(FASTDCP_\w+)"', (REPO / "setup.py").read_text()))
    return found


def documented_variables(text: str) -> set[str]:
    return {v for row in table_rows(section(text, "Environment variables")) for v in re.findall(r"`(FASTDCP_\w+)`", row[0])}


def renamed_rows(text: str) -> list[tuple[str, str, str]]:
    out = []
    for row in table_rows(section(text, "Renamed")):
        old, new = re.fullmatch(r"`(\w+)`", row[0]), re.fullmatch(r"`(\w+)`", row[1]) if len(row) > 1 else None
        if old and new:
            out.append((old.group(1), new.group(1), row[2] if len(row) > 2 else ""))
    return out


def environment_problems(text: str, read: set[str]) -> list[str]:
    documented = documented_variables(text)
    old_names = set(_renamed.RENAMED_ENVIRONMENT.values())
    problems = [f"{v} is read but not documented under '## Environment variables'"
                for v in sorted(read - documented - set(UNDOCUMENTED_TEST_HOOKS) - old_names)]
    renamed = {(old, new) for old, new, _ in renamed_rows(text)}
    problems += [f"{old} (renamed {new}) is not in the '## Renamed' table"
                 for new, old in _renamed.RENAMED_ENVIRONMENT.items() if (old, new) not in renamed]
    return problems


def rename_problems(text: str) -> list[str]:
    rows = renamed_rows(text)
    problems = []
    for owner, renames in _renamed.RENAMED_ARGUMENTS.items():
        for old, new in renames.items():
            where = " ".join(w for o, n, w in rows if (o, n) == (old, new))
            if f"`{owner}`" not in where:
                problems.append(f"{owner}: {old} -> {new} is not in the '## Renamed' table")
    return problems


def wording_problems(text: str) -> list[str]:
    return [f"development wording {pattern!r}: {m.group(0)!r}" for pattern in FORBIDDEN_WORDING
            for m in re.finditer(pattern, text, re.I)]


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


def test_every_public_name_has_its_entry_with_the_code_s_signature():
    assert api_problems(API_MD.read_text()) == []


def test_every_environment_variable_is_documented():
    read = variables_read()
    assert {"FASTDCP_DIRECT_IO", "FASTDCP_TEST_DIRECT_EINVAL", "FASTDCP_BUILD_CUDA"} <= read, "the scan is broken"
    assert environment_problems(API_MD.read_text(), read) == []


def test_documented_variables_and_test_hooks_exist():
    sources = " ".join(p.read_text() for d in ("fastdcp", "tests", "csrc") for p in (REPO / d).rglob("*")
                       if p.suffix in (".py", ".cpp", ".h", ".hpp", ".cu"))
    sources += (REPO / "setup.py").read_text()
    for v in documented_variables(API_MD.read_text()) | set(UNDOCUMENTED_TEST_HOOKS):
        assert v in sources, f"{v} is documented (or exempted) but nothing reads it"
    documented = documented_variables(API_MD.read_text())
    assert not documented & set(UNDOCUMENTED_TEST_HOOKS), "an exempted hook is documented: drop its exemption"


def test_every_rename_is_listed():
    assert _renamed.RENAMED_ARGUMENTS, "no renamed arguments registered: the decorator did not run"
    assert rename_problems(API_MD.read_text()) == []


def test_the_reference_speaks_about_the_product_only():
    assert wording_problems(API_MD.read_text()) == []


def test_open_is_public_but_not_exported_by_star():
    assert "open" not in fastdcp.__all__
    assert callable(fastdcp.open) and fastdcp.open.__module__ == "fastdcp.objstore.lazy"
    namespace: dict = {}
    exec("from fastdcp import *", namespace)  # noqa: S102
    assert "open" not in namespace and namespace.get("FastFileSystemWriter") is fastdcp.FastFileSystemWriter
    exec("from fastdcp import *\nresult = open", namespace)  # noqa: S102
    assert namespace["result"] is builtins.open
    assert all(hasattr(fastdcp, n) for n in fastdcp.__all__)


# The checks themselves, on broken samples: each must catch what it is there for.

_GOOD = """# API

### `warm_up`

```text
warm_up(state_dict=None, *, ring_bytes=256 << 20, load_bytes=512 << 20)
```

| argument | default |
|---|---|
| `state_dict` | `None` |
| `ring_bytes` | 256 MiB |
| `load_bytes` | 512 MiB |

### `WarmUpReport`

`pinned_bytes`, `staging_bytes`, `seconds`.

### `FastFileSystemReader`

```text
FastFileSystemReader(path, _extension_registry=None, *, direct_io=None, io_threads=None, task_bytes=None,
                     read_buffer_limit_bytes=None, allow_unsafe_metadata=False, verify_checksums=None,
                     load_deadline_s=FROM_ENV, read_once=None)
```

`path`, `_extension_registry`, `direct_io`, `io_threads`, `task_bytes`, `read_buffer_limit_bytes`,
`allow_unsafe_metadata`, `verify_checksums`, `load_deadline_s`, `read_once`.

## Exceptions and warnings

| name | base |
|---|---|
| `LoadDeadlineError` | `TimeoutError` |
| `ObjectNotFoundError` | `ObjectStoreError`, `FileNotFoundError` |

## Environment variables

| variable | what it sets |
|---|---|
| `FASTDCP_IO_THREADS` | `io_threads` |

## Renamed

| old name | new name | where |
|---|---|---|
| `memory_budget_bytes` | `read_buffer_limit_bytes` | `FastFileSystemReader`, `fastdcp.open` |
| `FASTDCP_READ_BUDGET_BYTES` | `FASTDCP_READ_BUFFER_LIMIT_BYTES` | environment |
"""


def _problems_for(sample: str, name: str) -> list[str]:
    return [p for p in api_problems(sample) if p.startswith(name + ":") or p.startswith(name + "(")]


def test_the_checks_pass_a_good_sample():
    for name in ("warm_up", "WarmUpReport", "FastFileSystemReader", "LoadDeadlineError", "ObjectNotFoundError"):
        assert _problems_for(_GOOD, name) == [], name
    assert _problems_for(_GOOD, "StagingReport"), "a missing entry went unnoticed"
    assert set(entries(_GOOD)) == {"warm_up", "WarmUpReport", "FastFileSystemReader"}
    assert documented_variables(_GOOD) == {"FASTDCP_IO_THREADS"}
    assert renamed_rows(_GOOD)[0] == ("memory_budget_bytes", "read_buffer_limit_bytes",
                                      "`FastFileSystemReader`, `fastdcp.open`")
    assert wording_problems(_GOOD) == []


@pytest.mark.parametrize("broken,name", [
    (_GOOD.replace("ring_bytes=256 << 20", "ring_bytes=128 << 20"), "warm_up"),         # a wrong default
    (_GOOD.replace(", *, ring_bytes", ", ring_bytes"), "warm_up"),                        # keyword-only lost
    (_GOOD.replace("| `load_bytes` | 512 MiB |\n", ""), "warm_up"),                       # an argument unexplained
    (_GOOD.replace("load_deadline_s=FROM_ENV,", "load_deadline_s=None,"), "FastFileSystemReader"),  # a sentinel as None
    (_GOOD.replace(" verify_checksums=None,\n", "\n"), "FastFileSystemReader"),           # a parameter left out
    (_GOOD.replace("`pinned_bytes`, ", ""), "WarmUpReport"),                              # a dataclass field left out
    (_GOOD.replace("### `WarmUpReport`", "### WarmUpReport"), "WarmUpReport"),           # not a name heading
    (_GOOD.replace("```text\nwarm_up(", "```python\nwarm_up("), "warm_up"),               # no signature block
    (_GOOD.replace("`ObjectStoreError`, `FileNotFoundError`", "`ObjectStoreError`"), "ObjectNotFoundError"),  # a base
    (_GOOD.replace("| `LoadDeadlineError` | `TimeoutError` |\n", ""), "LoadDeadlineError"),  # no row
], ids=["default", "kind", "unexplained", "sentinel", "missing-parameter", "field", "heading", "no-text-block",
        "base", "no-row"])
def test_a_broken_entry_is_caught(broken, name):
    assert _problems_for(broken, name), name


def test_a_missing_environment_variable_or_rename_is_caught():
    read = {"FASTDCP_IO_THREADS", "FASTDCP_TEST_FAKE_PINNED"}
    assert environment_problems(_GOOD, read) == [p for p in environment_problems(_GOOD, read) if "Renamed" in p]
    assert environment_problems(_GOOD, read | {"FASTDCP_NEW_KNOB"}) != environment_problems(_GOOD, read)
    # A variable named only in prose, or only in another section's table, is not documented.
    prose_only = _GOOD.replace("| `FASTDCP_IO_THREADS` | `io_threads` |\n", "") + "\nSet `FASTDCP_IO_THREADS`.\n"
    assert any("FASTDCP_IO_THREADS" in p for p in environment_problems(prose_only, read))
    assert any("FASTDCP_STAGING_POOL_BYTES" in p for p in environment_problems(_GOOD, read))  # not in the sample's table
    assert variables_in_python('"""FASTDCP_DOC_ONLY"""\nx = "FASTDCP_REAL"  # FASTDCP_COMMENT\n') == {"FASTDCP_REAL"}
    problems = rename_problems(_GOOD)
    assert not any(p.startswith("FastFileSystemReader:") or p.startswith("fastdcp.open:") for p in problems)
    assert any(p.startswith("FastS3Reader:") for p in problems)


def test_development_wording_is_caught():
    for bad in ("as the session that set this up found", "see issue 12", "on the development VM",
                "the machine we were lent", "a borrowed machine"):
        assert wording_problems(bad), bad
    assert wording_problems("a session of the training job; measured 2026-11-26 at commit a6b6327") == []
