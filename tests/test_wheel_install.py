"""The wheel builds from a copy of the source tree, installs into a clean virtualenv (no network,
no dependency resolution: the torch and numpy already installed are made visible to it) and its
console script runs: ``attnkit --version`` and ``attnkit explain``."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import attnkit

ROOT = Path(__file__).resolve().parent.parent


# no PYTHONPATH anywhere: a checkout on it (with its egg-info) would look like an installed attnkit
CLEAN_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(*cmd, **kw):
    kw.setdefault("env", CLEAN_ENV)
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=240, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.mark.slow
def test_wheel_builds_installs_and_runs(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools (the build backend)")
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = tmp_path / "wheels"
    # --no-build-isolation: the build backend already installed, nothing fetched
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", wheels, src)
    built = sorted(wheels.glob("attnkit-*.whl"))
    assert [w.name for w in built] == [f"attnkit-{attnkit.__version__}-py3-none-any.whl"]

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    venv_site = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    # the dependencies (torch, numpy) come from this interpreter's site-packages, added AFTER the
    # clean venv's own: the attnkit that runs is the wheel's, never a checkout or an editable install
    # (written after the install: pip must not see an attnkit installed elsewhere and skip the wheel)
    _run(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", built[0])
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    (venv_site / "zz_deps.pth").write_text("\n".join(sorted(deps)) + "\n", encoding="utf-8")

    env = CLEAN_ENV
    where = _run(py, "-c", "import attnkit; print(attnkit.__file__)", env=env, cwd=tmp_path).stdout.strip()
    assert Path(where).resolve().is_relative_to(venv_site.resolve()), where
    exe = venv / ("Scripts/attnkit.exe" if os.name == "nt" else "bin/attnkit")
    assert _run(exe, "--version", env=env, cwd=tmp_path).stdout.strip() == f"attnkit {attnkit.__version__}"
    out = _run(exe, "explain", env=env, cwd=tmp_path).stdout
    assert "0.4011" in out and "5.0000" in out
