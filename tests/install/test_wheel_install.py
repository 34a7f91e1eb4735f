"""The wheel builds from a copy of the source tree, installs into a clean virtualenv (no network,
no dependency resolution: the torch and numpy already installed are made visible to it) and its
console script runs: ``attnkit --version`` and ``attnkit explain``. The wheel carries the compiled
CPU kernel, built then; a build whose compiler fails still installs, and runs torch's kernels with
one warning."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT

import attnkit

# no PYTHONPATH anywhere: a checkout on it (with its egg-info) would look like an installed attnkit; the kernel built
# at -O1 (setup.py's ATTNKIT_NATIVE_OPT: a third of -O3's compile time; these tests check that it builds, installs
# and runs exactly, not its speed)
CLEAN_ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "ATTNKIT_NATIVE_OPT": "-O1"}


def _run(*cmd, **kw):
    kw.setdefault("env", CLEAN_ENV)
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=240, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    return r


def _build_and_install(tmp_path, env=CLEAN_ENV):
    """(python of a clean venv with the freshly built wheel installed, the wheel's path)."""
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools (the build backend)")
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "setup.py", "MANIFEST.in"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    wheels = tmp_path / "wheels"
    # --no-build-isolation: the build backend already installed, nothing fetched
    r = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-v",
             "-w", wheels, src, env=env)
    built = sorted(wheels.glob("attnkit-*.whl"))
    assert len(built) == 1 and built[0].name.startswith(f"attnkit-{attnkit.__version__}-"), built

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
    where = _run(py, "-c", "import attnkit; print(attnkit.__file__)", cwd=tmp_path).stdout.strip()
    assert Path(where).resolve().is_relative_to(venv_site.resolve()), where
    return py, venv, built[0], r.stdout + r.stderr


KERNEL = ("import warnings, torch, attnkit\n"
          "from attnkit import masks as M\n"
          "from attnkit.backends import _native\n"
          "q = k = v = torch.randn(1, 2, 128, 16)\n"
          "with warnings.catch_warnings(record=True) as w:\n"
          "    warnings.simplefilter('always')\n"
          "    out = attnkit.attention(q, k, v, mask=M.sliding_window(8))\n"
          "    attnkit.attention(q, k, v, mask=M.sliding_window(8))\n"
          "ref = attnkit.attention(q.double(), k.double(), v.double(), mask=M.sliding_window(8), backend='eager')\n"
          "print('worker:', attnkit.dispatch(q, k, v, mask=M.sliding_window(8)).worker)\n"
          "print('status:', _native.status())\n"
          "print('warnings:', len(w), [str(x.message)[:80] for x in w])\n"
          "print('error:', float((out.double() - ref).abs().max()))\n")


@pytest.mark.slow
def test_wheel_builds_installs_and_runs(tmp_path):
    py, venv, wheel, _ = _build_and_install(tmp_path)
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("attnkit/_native") and n.endswith((".so", ".pyd")) for n in names), names
    env = CLEAN_ENV
    exe = venv / ("Scripts/attnkit.exe" if os.name == "nt" else "bin/attnkit")
    assert _run(exe, "--version", env=env, cwd=tmp_path).stdout.strip() == f"attnkit {attnkit.__version__}"
    out = _run(exe, "explain", env=env, cwd=tmp_path).stdout
    assert "0.4011" in out and "5.0000" in out
    out = _run(py, "-c", KERNEL, cwd=tmp_path).stdout
    assert "worker: native" in out and "status: attnkit's compiled CPU kernel (" in out and "warnings: 0" in out, out
    assert float(out.split("error:")[1]) < 1e-5, out


@pytest.mark.slow
def test_a_wheel_whose_compiler_fails_installs_and_falls_back_with_one_warning(tmp_path):
    """No working C++ compiler at build time (CC/CXX point at `false`): pip reports the failed optional
    extension, the wheel still builds and installs, and attnkit runs torch's kernels, warning once."""
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` command to stand in for a broken compiler")
    env = dict(CLEAN_ENV, CC=false, CXX=false, LDSHARED=false)
    py, _, wheel, log = _build_and_install(tmp_path, env=env)
    import zipfile

    assert not any(n.startswith("attnkit/_native") for n in zipfile.ZipFile(wheel).namelist())
    assert "attnkit._native" in log and "failed" in log.lower(), log[-2000:]
    out = _run(py, "-c", KERNEL, cwd=tmp_path).stdout
    assert "worker: fused" in out and "warnings: 1" in out and "without its compiled CPU kernel" in out, out
    assert float(out.split("error:")[1]) < 1e-5, out
