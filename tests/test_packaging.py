"""What ``pip install .`` and the sdist contain: only the ``fastdcp`` package lands in
site-packages (the benchmark suite is ``fastdcp.bench``, no top-level ``benchmarks`` that would
collide with another project's), and the sdist carries every source the build needs."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import setuptools

REPO = Path(__file__).resolve().parents[1]


def test_only_the_fastdcp_package_is_installed():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = setuptools.find_packages(where=str(REPO), include=include)
    assert "fastdcp" in packages and "fastdcp.bench" in packages, packages
    outside = [p for p in packages if p.split(".")[0] != "fastdcp"]
    assert outside == [], f"pip install would place top-level packages {outside} in site-packages"


def test_the_sdist_carries_every_source_of_the_build(tmp_path):
    env = dict(os.environ, FASTDCP_BUILD_CUDA="0")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=REPO, env=env,
                   check=True, capture_output=True, text=True, timeout=300)
    (archive,) = tmp_path.glob("fastdcp-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    # The sources on disk (not git's list: CI also runs this in a copy of the tree without .git).
    wanted = [str(p.relative_to(REPO)) for pattern in ("csrc/**/*.cpp", "csrc/**/*.hpp", "csrc/**/*.cu",
                                                        "csrc/**/*.cuh", "fastdcp/**/*.py")
              for p in REPO.glob(pattern)]
    wanted += ["setup.py", "pyproject.toml", "README.md"]
    assert any(w.endswith(".cu") for w in wanted) and len(wanted) > 50, wanted
    missing = sorted(set(wanted) - names)
    assert missing == [], f"the sdist lacks {missing}"
    assert not any(n.startswith("benchmarks/") for n in names)
