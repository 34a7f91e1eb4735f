"""tools/install-torch.sh (what the Makefile runs): a torch already installed is kept without
touching the network; otherwise a local wheel, else the CPU-only index on a machine without an
NVIDIA GPU, else PyPI's CUDA build — and an index that does not answer fails at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT

SCRIPT = ROOT / "tools" / "install-torch.sh"
UNREACHABLE = "http://127.0.0.1:9/simple"  # the discard port: refused at once

pytestmark = pytest.mark.skipif(os.name == "nt", reason="a bash script")


def _run(python, tmp_path, gpu: bool | None = None, **env):
    e = dict(os.environ, WHEEL_DIR=str(tmp_path / "no-wheels"), TORCH_INDEX=UNREACHABLE,
             CONSTRAINTS=str(ROOT / "constraints.txt"))
    e.update(env)
    if gpu is not None:  # a fake nvidia-smi first on PATH
        bin_ = tmp_path / "fakebin"
        bin_.mkdir(exist_ok=True)
        (bin_ / "nvidia-smi").write_text(f"#!/bin/sh\nexit {0 if gpu else 9}\n")
        (bin_ / "nvidia-smi").chmod(0o755)
        e["PATH"] = f"{bin_}{os.pathsep}{e['PATH']}"
    start = time.perf_counter()
    r = subprocess.run(["bash", str(SCRIPT), str(python)], capture_output=True, text=True, env=e, timeout=60)
    return r, time.perf_counter() - start


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A fresh venv's python: no torch (and no pip: the script must decide before it needs one)."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    return venv / "bin" / "python"


def test_installed_torch_is_kept_without_network(tmp_path):
    pytest.importorskip("torch")
    r, took = _run(sys.executable, tmp_path, TORCH_VERSION=__import__("torch").__version__.split("+")[0])
    assert r.returncode == 0, r.stderr
    assert "already installed; keeping it" in r.stdout and "would run" not in r.stdout
    assert took < 30


def test_no_gpu_uses_the_cpu_index(bare_python, tmp_path):
    r, _ = _run(bare_python, tmp_path, gpu=False, TORCH_DRY_RUN="1", TORCH_INDEX="https://download.pytorch.org/whl/cpu")
    assert r.returncode == 0, r.stderr
    assert "no NVIDIA GPU found" in r.stdout
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in r.stdout


def test_gpu_uses_pypi(bare_python, tmp_path):
    r, _ = _run(bare_python, tmp_path, gpu=True, TORCH_DRY_RUN="1")
    assert r.returncode == 0, r.stderr
    assert "with CUDA" in r.stdout and "--index-url" not in r.stdout and r.stdout.rstrip().endswith("torch==2.13.0")


def test_local_wheel_comes_first(bare_python, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    r, _ = _run(bare_python, tmp_path, gpu=True, TORCH_DRY_RUN="1", WHEEL_DIR=str(wheels))
    assert r.returncode == 0, r.stderr
    assert f"--find-links {wheels} torch==2.13.0" in r.stdout


def test_unreachable_index_fails_at_once(bare_python, tmp_path):
    r, took = _run(bare_python, tmp_path, gpu=False)
    assert r.returncode == 1
    assert f"{UNREACHABLE} does not answer" in r.stderr and "WHEEL_DIR" in r.stderr
    assert took < 15


@pytest.mark.parametrize("mode, needle", [("bogus", "expected auto, installed, local, cpu or cuda"),
                                          ("installed", "cannot import torch==2.13.0"),
                                          ("local", "no torch-2.13.0*.whl in WHEEL_DIR")])
def test_bad_settings_are_reported(bare_python, tmp_path, mode, needle):
    r, _ = _run(bare_python, tmp_path, TORCH=mode)
    assert r.returncode in (1, 2) and needle in r.stderr


def test_makefile_installs_torch_through_the_script(tmp_path):
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make")
    r = subprocess.run(["make", "-n", "venv", f"VENV={tmp_path / 'v'}", "TORCH=cuda"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any("tools/install-torch.sh" in ln for ln in lines)
    assert not any("torch==" in ln for ln in lines)  # never a bare `pip install torch` (the CUDA stack)
    assert any("[2/3] torch 2.13.0 (TORCH=cuda)" in ln for ln in lines)
