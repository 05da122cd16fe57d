"""The package layout docs/ARCHITECTURE.md describes: one folder per stage, dependencies pointing
one way, no import cycles, ``format/`` free of file I/O, and no library module longer than
MAX_LINES. Read from the source (every import statement, including the ones inside functions),
so nothing has to be imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fastdcp"

# The bottom module: the one way to the native extension fastdcp._C; every part may import it.
BOTTOM = "fastdcp._native"
# The package's face: the public API (its __init__) and ``python -m fastdcp``. Nothing below imports them.
FACE = {"fastdcp", "fastdcp.__main__"}
# What each part of the package may import from fastdcp (besides itself and BOTTOM).
ALLOWED = {
    "compat": set(),
    "format": {"compat"},
    "io": {"format", "compat"},
    "save": {"format", "io", "compat"},
    "load": {"format", "io", "compat"},
    "planners": {"format", "io", "compat"},
    "cli": {"format", "io", "load", "objstore", "compat"},
    "objstore": {"format", "io", "save", "load", "compat"},
    "tiered": {"format", "io", "save", "load", "objstore", "compat"},
}
# The top-level modules below the face, and what each may import from fastdcp: the bottom module
# only the extension and its error message; default_storage (behind ``enable()``) the stages whose
# classes it installs, and nothing imports it but the face.
TOP_ALLOWED = {
    "_extension_error": set(),
    "_native": {"_C", "_extension_error"},
    "default_storage": {"compat", "io", "save", "load", "objstore"},
}
TOP_LEVEL = {"fastdcp", "fastdcp.__main__", "fastdcp._C"}
# The longest a module of the library may be (the benchmark suite, bench/, is not the library).
MAX_LINES = 800
# Calls that read or inspect a file: none of them in format/, which gets bytes or a
# PositionalSource (fastdcp/format/sources.py) that io/ implements. ``.fileno()`` on anything.
FILE_IO_CALLS = {("builtins", "open"), ("os", "open"), ("os", "pread"), ("os", "preadv"), ("os", "read"),
                 ("os", "fstat"), ("os", "stat"), ("io", "open")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The fastdcp modules ``name`` imports (``from .x import y`` counts ``x.y`` when that is a
    module, else ``x``)."""
    is_package = path.name == "__init__.py"
    package_parts = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "fastdcp"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package_parts[: len(package_parts) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "fastdcp":
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules) | {"fastdcp._C"}
    return {name: _imports(name, path, known) - {name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) == 2 and parts[1] in TOP_ALLOWED else None


def test_the_checks_catch_a_cycle_and_a_wrong_direction():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _wrong_directions({"fastdcp.format.x": {"fastdcp.load.y"}}) == ["fastdcp.format.x -> fastdcp.load.y"]
    assert _wrong_directions({"fastdcp.save.x": {"fastdcp.default_storage"}}) == ["fastdcp.save.x -> fastdcp.default_storage"]
    assert _wrong_directions({"fastdcp.format.x": {"fastdcp._native"}}) == []
    assert _wrong_directions({"fastdcp._native": {"fastdcp.io.engine"}}) == ["fastdcp._native -> fastdcp.io.engine"]
    assert _wrong_directions({"fastdcp.default_storage": {"fastdcp.tiered.x"}}) == [
        "fastdcp.default_storage -> fastdcp.tiered.x"]
    assert _wrong_directions({"fastdcp.default_storage": {"fastdcp"}}) == ["fastdcp.default_storage -> fastdcp"]
    assert _past_the_bottom({"fastdcp.io.x": {"fastdcp._C"}, "fastdcp.load.y": {"fastdcp"},
                             "fastdcp.bench.z": {"fastdcp", "fastdcp._C"}, "fastdcp._native": {"fastdcp._C"},
                             "fastdcp": {"fastdcp._native"}}) == [
        "fastdcp.bench.z -> fastdcp._C", "fastdcp.io.x -> fastdcp._C", "fastdcp.load.y -> fastdcp"]


def test_the_graph_sees_every_module_and_its_imports():
    graph = _graph()
    assert {"fastdcp.format.blob", "fastdcp.save.writer", "fastdcp.load.reader", "fastdcp.cli"} <= set(graph)
    assert "fastdcp.format.blob" in graph["fastdcp.save.writer"]
    assert "fastdcp.load.gpu_placement" in graph["fastdcp.load.placement"]
    assert "fastdcp._native" in graph["fastdcp.io.engine"]
    assert "fastdcp._native" in graph["fastdcp.format.checksums"]
    assert "fastdcp._C" in graph["fastdcp._native"]
    assert "fastdcp.default_storage" in graph["fastdcp"]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def _wrong_directions(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imported in graph.items():
        part = _part(module)
        top = _top(module)
        for target in imported:
            if part is not None:
                if _part(target) is None and target != BOTTOM:
                    # Never upward: the package's __init__ and the top-level modules (default_storage)
                    # sit above every stage; the extension is reached through the bottom module.
                    wrong.append(f"{module} -> {target}")
                target_part = _part(target)
                if target_part is not None and target_part != part and target_part not in ALLOWED[part]:
                    wrong.append(f"{module} -> {target}")
            elif top is not None:
                parts = target.split(".")
                if len(parts) < 2 or parts[1] not in TOP_ALLOWED[top] | {BOTTOM.split(".")[1]}:
                    wrong.append(f"{module} -> {target}")
    return sorted(wrong)


def _past_the_bottom(graph: dict[str, set[str]]) -> list[str]:
    """Imports of the package's face or of the extension itself by any module but the face and the
    bottom module (the benchmark, a user of the public API, may import the face)."""
    wrong = []
    for module, imported in graph.items():
        if module in FACE or module == BOTTOM:
            continue
        for target in imported:
            if target == "fastdcp._C" or (target == "fastdcp" and not module.startswith("fastdcp.bench")):
                wrong.append(f"{module} -> {target}")
    return sorted(wrong)


def test_only_the_bottom_module_imports_the_extension():
    # Every module reaches fastdcp._C through fastdcp/_native.py; none reaches up to fastdcp/__init__.py.
    assert _past_the_bottom(_graph()) == []


def test_dependencies_point_one_way():
    assert _wrong_directions(_graph()) == []


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_each_part_says_what_it_owns(part):
    init = PACKAGE / part / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc, f"{init} has no docstring saying what the folder owns"
    for path in sorted((PACKAGE / part).glob("*.py")):
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path} has no module docstring"


def test_the_architecture_document_names_every_module():
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    missing = [
        name for name, path in _modules().items()
        if path.name != "__init__.py" and name not in TOP_LEVEL
        and str(path.relative_to(PACKAGE.parent)) not in text
    ]
    assert missing == [], f"docs/ARCHITECTURE.md does not mention {missing}"


# The stages whose classes other parts build on only through declared interfaces (a writer's sink,
# a reader's source, a lazy checkpoint's files), and the parts that build on them.
STAGES_WITH_SEAMS = ("save", "load")
BUILDING_ON_THEM = ("objstore", "tiered")


def _classes(part: str) -> dict[str, tuple[list[str], set[str]]]:
    """class name -> (base names, private method names) of every class in ``part``."""
    found: dict[str, tuple[list[str], set[str]]] = {}
    for path in sorted((PACKAGE / part).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases]
                methods = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and f.name.startswith("_") and not f.name.endswith("__")}
                found[node.name] = (bases, methods)
    return found


def _private_overrides(stages: dict[str, tuple[list[str], set[str]]],
                       builders: dict[str, tuple[list[str], set[str]]]) -> list[str]:
    """``Class.method`` for each private method a builder class redefines from a stage class it
    derives from (through its bases, by name)."""
    def stage_ancestors(name: str, seen: set[str]) -> set[str]:
        if name in seen:
            return set()
        seen.add(name)
        bases = (stages.get(name) or builders.get(name) or ([], set()))[0]
        found = {b for b in bases if b in stages}
        for b in bases:
            found |= stage_ancestors(b, seen)
        return found

    problems = []
    for name, (_, methods) in sorted(builders.items()):
        inherited = set().union(*(stages[a][1] for a in stage_ancestors(name, set()))) if methods else set()
        problems += [f"{name}.{m}" for m in sorted(methods & inherited)]
    return problems


def test_no_part_overrides_a_private_method_of_the_stages_it_builds_on():
    stages = {}
    for part in STAGES_WITH_SEAMS:
        stages.update(_classes(part))
    builders = {}
    for part in BUILDING_ON_THEM:
        builders.update(_classes(part))
    assert {"FastFileSystemWriter", "FastFileSystemReader", "LazyCheckpoint"} <= set(stages)
    assert _private_overrides(stages, builders) == []


def test_the_override_check_catches_one():
    stages = {"Base": ([], {"_write_files", "_helper"})}
    builders = {"Mid": (["Base"], set()), "Store": (["Mixin", "Mid"], {"_write_files", "_own"})}
    assert _private_overrides(stages, builders) == ["Store._write_files"]


def _long_modules(modules: dict[str, Path]) -> list[str]:
    """``name (n lines)`` of every module outside the benchmark suite longer than MAX_LINES."""
    found = []
    for name, path in modules.items():
        if name == "fastdcp.bench" or name.startswith("fastdcp.bench."):
            continue
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            found.append(f"{name} ({lines} lines)")
    return sorted(found)


def _file_io_calls(source: str, module: str) -> list[str]:
    """``module:line call`` of every call in ``source`` that reads or inspects a file
    (FILE_IO_CALLS, through ``import os``, ``import io as x`` or ``from os import pread``; and
    ``.fileno()``)."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> "os" / "io"
    names: dict[str, tuple[str, str]] = {"open": ("builtins", "open")}  # local name -> (module, name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update({a.asname or a.name: a.name for a in node.names if a.name in ("os", "io")})
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module in ("os", "io"):
            names.update({a.asname or a.name: (node.module, a.name) for a in node.names})
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, call = node.func, None
        if isinstance(func, ast.Name) and names.get(func.id) in FILE_IO_CALLS:
            call = ".".join(names[func.id]).removeprefix("builtins.")
        elif isinstance(func, ast.Attribute):
            if func.attr == "fileno":
                call = ".fileno()"
            elif isinstance(func.value, ast.Name) and (modules.get(func.value.id), func.attr) in FILE_IO_CALLS:
                call = f"{modules[func.value.id]}.{func.attr}"
        if call is not None:
            found.append((node.lineno, f"{module}:{node.lineno} {call}"))
    return [text for _, text in sorted(found)]


def test_the_size_and_file_io_checks_catch_what_they_look_for(tmp_path):
    long, short, bench = tmp_path / "long.py", tmp_path / "short.py", tmp_path / "bench.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    short.write_text("x = 1\n" * MAX_LINES)
    bench.write_text("x = 1\n" * (MAX_LINES + 1))
    assert _long_modules({"fastdcp.format.long": long, "fastdcp.format.short": short,
                          "fastdcp.bench.suite": bench}) == [f"fastdcp.format.long ({MAX_LINES + 1} lines)"]
    source = ("import os, io as stream\nfrom os import pread as p, path\n"
              "open('x')\nos.fstat(3)\nstream.open('y')\np(1, 2, 3)\nf.fileno()\n"
              "os.path.join('a', 'b')\npath.exists('c')\nos.preadv(1, [], 0)\nos.stat('d')\nos.read(1, 2)\n")
    assert _file_io_calls(source, "m") == ["m:3 open", "m:4 os.fstat", "m:5 io.open", "m:6 os.pread", "m:7 .fileno()",
                                           "m:10 os.preadv", "m:11 os.stat", "m:12 os.read"]


def test_no_library_module_is_longer_than_the_limit():
    assert _long_modules(_modules()) == [], f"modules over {MAX_LINES} lines: split them by concept"


def test_format_does_no_file_io():
    found = []
    for name, path in _modules().items():
        if _part(name) == "format":
            found += _file_io_calls(path.read_text(), name)
    assert found == [], ("format/ is pure: it reads bytes or a PositionalSource (format/sources.py), "
                         f"io/ touches the files; found {found}")
