"""Issue 40, packaging: the wheel shipped `*.cu` but not `*.cuh`, which kernels/nvrtc.py reads at run time:
a wheel install could not compile the kernels and fell back to the slow path without a word. The wheel
is built here from a copy of the checkout and must hold every file of the package (each module and each
data file the code opens next to itself)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "qerl"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("setuptools")
    work = tmp_path_factory.mktemp("build")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, work / name)
    shutil.copytree(ROOT / "src", work / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(work / "dist"), str(work)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = (work / "dist").glob("qerl-*.whl")
    with zipfile.ZipFile(whl) as z:
        return set(z.namelist())


def _package_files() -> set[str]:
    """Every committed file of the package (the reference; files on disk without git), as a wheel names it."""
    r = subprocess.run(["git", "ls-files", "src/qerl"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode == 0 and r.stdout.strip():
        return {f"qerl/{Path(x).relative_to('src/qerl').as_posix()}" for x in r.stdout.split()
                if (ROOT / x).is_file()}
    return {f"qerl/{p.relative_to(PKG).as_posix()}" for p in PKG.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")}


def test_the_wheel_holds_every_file_of_the_package(wheel):
    missing = sorted(_package_files() - wheel)
    assert not missing, f"not in the wheel: {missing}"


def test_every_kernel_header_the_code_reads_is_in_the_wheel(wheel):
    """The names of .cu / .cuh files in the kernels' source (what nvrtc.py opens) are all shipped."""
    named = set()
    for py in (PKG / "kernels").glob("*.py"):  # file names in the loaders (not nvrtc's program names)
        named |= {n for n in re.findall(r"[\"']([\w./-]+\.cuh?)[\"']", py.read_text())
                  if (PKG / "kernels" / Path(n).name).is_file()}
    for src in (PKG / "kernels").glob("*.cu*"):  # and every header the kernels #include from next to them
        named |= set(re.findall(r'#include\s+"([\w./-]+\.cuh?)"', src.read_text()))
    assert any(n.endswith(".cuh") for n in named), named  # the reference itself finds the headers
    for n in named:
        assert f"qerl/kernels/{Path(n).name}" in wheel, n
