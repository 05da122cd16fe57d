"""The torch internals fastdcp relies on (fastdcp/compat/torch_internals.py): each entry resolves on
the torch under test (one test per name, so a missing one fails naming it), the source uses no
private torch name without an entry, a missing one refuses with a clear error, and the release
differences the module names are followed on whatever torch runs the suite."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

import dcp_cases as C
from fastdcp.compat import torch_internals as TI

PACKAGE = Path(__file__).resolve().parents[2] / "fastdcp"


@pytest.mark.parametrize("internal", [i for i in TI.INTERNALS if i.required], ids=lambda i: i.qualified)
def test_every_required_internal_exists_in_this_torch(internal):
    try:
        TI.resolve(internal)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"torch {torch.__version__} lacks {internal.qualified} (fastdcp's {internal.used_by}: "
                    f"{internal.used_for}): {type(e).__name__}: {e}")


@pytest.mark.parametrize("internal", [i for i in TI.INTERNALS if not i.required], ids=lambda i: i.qualified)
def test_an_optional_internal_resolves_or_is_reported_missing(internal):
    missing = dict((i.qualified, why) for i, why in TI.missing_internals((internal,)))
    try:
        TI.resolve(internal)
    except (ImportError, AttributeError):
        assert internal.qualified in missing
    else:
        assert not missing


# --------------------------------------------------------------------------- the source


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def private_torch_names(source: str) -> set[str]:
    """Every dotted torch path with a private part that ``source`` uses: imports (``import torch._x``,
    ``from torch.a import _b``), attribute chains on an imported torch name or module alias
    (``_stock_fs._Name``, ``torch._utils._f``), a local alias of one (``s = torch.serialization``),
    and ``getattr(alias, "_name", ...)``."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    found: set[str] = set()

    def dotted(node: ast.AST) -> str | None:
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in aliases:
            return ".".join([aliases[node.id], *reversed(chain)])
        return None

    def note(path: str) -> None:
        if _private(path.split(".")):
            found.add(path)

    nodes = list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
                    note(a.name)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                note(full)
    for node in nodes:  # local aliases: name = torch.something
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            path = dotted(node.value)
            if path is not None:
                aliases.setdefault(node.targets[0].id, path)
    for node in nodes:
        if isinstance(node, ast.Attribute):
            path = dotted(node)
            if path is not None:
                note(path)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            base = dotted(node.args[0]) if isinstance(node.args[0], ast.Attribute) else aliases.get(
                getattr(node.args[0], "id", None))
            if base is not None and node.args[1].value.startswith("_") and not node.args[1].value.startswith("__"):
                found.add(f"{base}.{node.args[1].value}")
    return found


def _covered(path: str) -> bool:
    """A registered internal, a module one is in, or an attribute reached through one."""
    for internal in TI.INTERNALS:
        q = internal.qualified
        if path == q or path.startswith(q + ".") or path == internal.module or internal.module.startswith(path + "."):
            return True
    return False


def test_the_scanner_finds_every_form_of_use():
    source = textwrap.dedent("""
        import torch
        import torch.distributed.checkpoint._a as a_mod
        from torch.distributed.checkpoint import filesystem as fs
        from torch.distributed.checkpoint.filesystem import _StorageInfo, FileSystemWriter
        x = torch._utils._element_size(torch.float32)
        s = torch.serialization
        s._get_layout
        fs._split
        getattr(fs, "_Unpickler", None)
        FileSystemWriter.public
        fs.public
    """)
    assert private_torch_names(source) >= {
        "torch.distributed.checkpoint._a", "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch._utils._element_size", "torch.serialization._get_layout", "torch.distributed.checkpoint.filesystem._split",
        "torch.distributed.checkpoint.filesystem._Unpickler",
    }
    assert not any("public" in name for name in private_torch_names(source))


def test_every_private_torch_name_in_the_source_is_registered():
    unregistered: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in private_torch_names(path.read_text()):
            if not _covered(name):
                unregistered.setdefault(name, []).append(str(path.relative_to(PACKAGE.parent)))
    assert not unregistered, (
        "private torch names used without an entry in fastdcp/compat/torch_internals.py INTERNALS: "
        + "; ".join(f"{name} ({', '.join(files)})" for name, files in sorted(unregistered.items()))
    )


# --------------------------------------------------------------------------- a missing internal


def test_a_missing_internal_refuses_naming_the_torch_version_and_the_piece():
    gone = TI.Internal("torch.distributed.checkpoint.filesystem", "_NoSuchThing", "save/writer", "something vital")
    gone_module = TI.Internal("torch.distributed.checkpoint._no_such_module", None, "load", "another thing")
    optional = TI.Internal("torch", "_no_such_optional", "io", "a fallback exists", required=False)
    with pytest.raises(TI.TorchInternalsMissing) as info:
        TI.require_internals(TI.INTERNALS + (gone, gone_module, optional))
    message = str(info.value)
    assert f"torch {torch.__version__}" in message and "2 internal(s)" in message
    assert "torch.distributed.checkpoint.filesystem._NoSuchThing" in message and "something vital" in message
    assert "torch.distributed.checkpoint._no_such_module" in message and "_no_such_optional" not in message
    assert isinstance(info.value, ImportError)
    TI.require_internals(TI.INTERNALS + (optional,))  # an optional one alone refuses nothing


def test_import_fastdcp_refuses_on_a_torch_without_a_required_internal(tmp_path):
    """In a fresh interpreter, with a required internal deleted from torch before fastdcp is
    imported: ``import fastdcp`` raises TorchInternalsMissing naming it."""
    script = textwrap.dedent("""
        import torch.distributed.checkpoint.planner_helpers as ph
        del ph._create_chunk_list
        try:
            import fastdcp
        except ImportError as e:
            print(type(e).__name__, e)
        else:
            print("imported")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.stdout.startswith("TorchInternalsMissing"), out.stdout + out.stderr
    assert "planner_helpers._create_chunk_list" in out.stdout and torch.__version__ in out.stdout


# --------------------------------------------------------------------------- release differences


def _metadata(chunks: list[tuple[list[int], list[int]]], size: list[int]) -> Metadata:
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                               [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    return Metadata({"w": md})


def test_stock_validation_is_read_in_this_releases_form():
    valid = TI.valid_plan_result()
    assert valid is True or valid == []  # True up to 2.11, [] since 2.13
    plans = [SavePlan([])]
    good = default_planner._validate_global_plan(plans, _metadata([([0, 0], [4, 4])], [4, 4]))
    assert good == valid and TI.validation_passed(good) == (True, [])
    with C.warnings_logged_by(default_planner.logger) as logged:
        bad = default_planner._validate_global_plan(plans, _metadata([([0, 0], [4, 8])], [4, 4]))
    passed, messages = TI.validation_passed(bad)
    assert not passed and any("out of bounds" in m for m in logged)
    assert messages == ([] if isinstance(bad, bool) else bad) and (isinstance(bad, bool) or messages)


def test_fastdcps_stand_in_for_stock_validation_passes_a_plan_on_this_release(tmp_path):
    """The plan_scale benchmark replaces stock's validation by a recorder: stock's planner must
    take its result as "valid" on this release (2.11 read [] as a failure)."""
    from fastdcp.bench.simulated_ranks import deferred_stock_validation

    planner = default_planner.DefaultSavePlanner()
    planner.set_up_planner({"w": torch.ones(4, 4)}, None, True)
    local = planner.create_local_plan()
    with deferred_stock_validation() as captured:
        plans, _ = planner.create_global_plan([local])
    assert len(captured) == 1 and len(plans) == 1
