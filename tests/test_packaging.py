"""A wheel (`python -m build --wheel`) installs into a fresh venv and runs: built with the C compiler, on the
extension; built where none is (`CC=false`), on its pure-Python twin, which is what the `optional` extension of
pyproject.toml promises an install without build tools.

Nothing is downloaded: the wheel is built without isolation (the dev extra brings `build` and setuptools), and
installed without its dependencies into a venv that finds them in this venv's site-packages, after its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import kvctl

SOURCE = Path(kvctl.__file__).resolve().parent.parent


def _run(*cmd: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _wheel(tmp_path: Path, compiler: str) -> Path:
    """The wheel of a copy of the project's sources (the checkout's own build outputs left behind)."""
    tree = tmp_path / "src"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(SOURCE / name, tree / name)
    shutil.copytree(SOURCE / "kvctl", tree / "kvctl", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    _run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", tmp_path / "dist", tree,
         env={**os.environ, "CC": compiler})
    (wheel,) = (tmp_path / "dist").glob("kvctl-*.whl")
    return wheel


COMPILERS = {"false": "none, pure Python", os.environ.get("CC", "cc"): "C"}  # $CC: the speedups it gives


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_wheel_installs_and_runs(tmp_path: Path, compiler: str) -> None:
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) on this machine to build the extension with")
    wheel = _wheel(tmp_path, compiler)
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (site / "kvctl_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index", wheel)

    installed = site / "kvctl"
    assert bool(list(installed.rglob("_native*.so"))) == (COMPILERS[compiler] == "C")
    env = {k: v for k, v in os.environ.items() if k not in ("KVCTL_PURE_PYTHON", "PYTHONPATH")}
    kvctl_bin = venv / "bin" / "kvctl"
    where = _run(python, "-c", "import kvctl; print(kvctl.__file__)", cwd=tmp_path, env=env)
    assert Path(where.strip()).parent == installed
    assert _run(kvctl_bin, "--version", cwd=tmp_path, env=env) == (
        f"kvctl {kvctl.__version__} (native speedups: {COMPILERS[compiler]})\n")
    # docs/contract.md's example: Dynamo's hashes of [1..8] in blocks of 4
    assert _run(kvctl_bin, "-o", "name", "hash", "-b", "4", "1", "2", "3", "4", "5", "6", "7", "8",
                cwd=tmp_path, env=env).split() == ["14643705804678351452", "4945711292740353085"]
