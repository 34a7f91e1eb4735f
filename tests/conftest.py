"""Shared test helpers: the float64 golden and error-budget tolerances, and the repository root.

This file stays at ``tests/``; the test files sit one folder below it, mirroring ``src/attnkit``
(``tests/core``, ``tests/backends``, ...). ``pyproject.toml`` puts ``tests/`` on ``sys.path``
(``pythonpath``), so every test file imports these helpers, ``_flashmask`` and ``_cp_spawn`` as
top-level modules. Test file names are unique across the folders (pytest's default import mode
imports each as a top-level module by its name).

Tolerances follow the flash-attention test habit: a backend's error against the
float64 golden must stay within a budget derived from the arithmetic, not a
hand-tuned constant.

* fp32/fp64: an attention output is a convex combination of V rows, each weight
  coming from a D-term dot product and an S-term normalisation, so the rounding
  error grows like eps·(√D + √S)·max|score|-ish; we allow ``C · eps · (√D + √S)``
  relative to the magnitude of V (C = 16).
* bf16/fp16: inputs are already rounded, so we compare with the error of the
  plain low-precision math path (scores in the low dtype) and allow a fudge
  factor of 2 of it, plus a floor of a few ulps.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import attnkit

# auto's crossovers are the defaults in every test (and every subprocess a test starts): a calibration file in
# the developer's cache must not change which backend a test sees. tests/core/test_calibrate.py turns it back on.
os.environ["ATTNKIT_CALIBRATION"] = "off"

ROOT = Path(__file__).resolve().parent.parent  # the repository (README.md, docs/, examples/, src/)

EPS = {torch.float64: 2.2e-16, torch.float32: 1.2e-7, torch.bfloat16: 7.8e-3, torch.float16: 9.8e-4}


def golden(q, k, v, **kw):
    """Float64 reference output (and lse) on float64 copies of the inputs."""
    def up(t):
        return t.detach().to(torch.float64) if isinstance(t, torch.Tensor) else np.asarray(t, np.float64)

    kw = dict(kw)
    m = kw.get("mask")
    if isinstance(m, torch.Tensor) and m.is_floating_point():
        kw["mask"] = m.to(torch.float64)
    return attnkit.attention(up(q), up(k), up(v), backend="reference", return_lse=True, **kw)


def full_path(q, k, v, **kw):
    """``attnkit.attention`` through the full path (make_request -> decide -> backend), no replay of
    :mod:`attnkit._fast`: what every replay must give, bit for bit."""
    from attnkit import _fast

    real = _fast.attention
    _fast.attention = lambda *a: None
    try:
        return attnkit.attention(q, k, v, **kw)
    finally:
        _fast.attention = real


def require_kernel():
    """For a test of attnkit's compiled kernel: skipped only where the user switched it off (``ATTNKIT_NATIVE=0``);
    a kernel that failed to build fails the test, loudly (``make test`` and ``pip install`` build it; the fallback
    without it is tested in tests/install/test_wheel_install.py)."""
    from attnkit.backends import _native

    if os.environ.get("ATTNKIT_NATIVE", "1").lower() in ("0", "off", "false", "no"):
        pytest.skip("the compiled kernel is switched off by ATTNKIT_NATIVE=0")
    assert _native.available(), _native.unavailable_reason()


def budget(dtype, D, S, scale_v=1.0):
    return 16 * EPS[dtype] * (math.sqrt(D) + math.sqrt(S)) * scale_v


def low_precision_error(q, k, v, ref_out, **kw):
    """Error of the naive math path run in the low dtype itself (scores in bf16/fp16)."""
    B, H, L, D = q.shape
    g = H // k.shape[1]
    kk = k.repeat_interleave(g, 1)
    vv = v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * (kw.get("scale") or D ** -0.5)
    req = attnkit._request.make_request(q, k, v, mask=kw.get("mask"), causal=kw.get("causal", False), scale=None,
                                        score_mod=None, dropout_p=0.0, return_lse=False, backend="eager")
    from attnkit.backends._tiles import allowed_tile
    allowed = allowed_tile(req, 0, L, 0, k.shape[2])
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
    out = p @ vv
    return (out.double() - ref_out).abs().max().item()


def assert_close(out, ref, atol, what=""):
    out = torch.as_tensor(out).double()
    ref = torch.as_tensor(ref).double()
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    err = (out - ref).abs().max().item() if out.numel() else 0.0
    assert err <= atol, f"{what}: max abs error {err:.3g} > budget {atol:.3g}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)


def rand_qkv(B, H, Hkv, L, S, D, Dv=None, dtype=torch.float32, scale=1.0, requires_grad=False):
    Dv = D if Dv is None else Dv
    q = (torch.randn(B, H, L, D, dtype=torch.float64) * scale).to(dtype)
    k = (torch.randn(B, Hkv, S, D, dtype=torch.float64) * scale).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, dtype=torch.float64).to(dtype)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


@contextlib.contextmanager
def fused(on: bool):
    """Run the tiled backend with its fused worker (torch's CPU flash kernel per run) switched on, or
    with the plain worker only; the compiled kernel is kept off either way (restored afterwards).
    ``native()`` selects the compiled kernel."""
    from attnkit.backends import tiled

    saved = tiled.FUSED, tiled.NATIVE
    tiled.FUSED, tiled.NATIVE = on, False
    try:
        yield
    finally:
        tiled.FUSED, tiled.NATIVE = saved


# The folders whose files each take a minute or more (several processes, subprocess installs, notebook and docs
# runs, model walks) go first: `make test` hands whole files to one worker per core (pytest-xdist --dist
# loadfile), and a long file handed out last would leave the other cores idle while it runs.
# The longest files first, longest first (their times under `make test`, 2 workers, 2026-11-26: each 60-170 s), then
# the rest of those folders.
_LONGEST_FILES = ("test_docs_examples.py", "test_distributed.py", "test_wheel_install.py",
                  "test_transformers_walk.py", "test_cp_transformers.py", "test_cp_weights.py", "test_fuzz.py",
                  "test_cli_explain.py")
_LONG_FIRST = ("distributed", "install", "docs", "integrations")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = Path(str(item.fspath))
        if path.name in _LONGEST_FILES:
            return _LONGEST_FILES.index(path.name)
        return len(_LONGEST_FILES) + next((i for i, d in enumerate(_LONG_FIRST) if d in path.parts), len(_LONG_FIRST))

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture
def kernel_takes_bf16(monkeypatch):
    """``auto``'s default table as on a CPU without bf16 instructions, where the compiled kernel takes bf16 calls:
    for tests whose subject is the kernel's bf16 path, so they test it on every CPU (on a CPU that multiplies bf16
    in hardware the default keeps bf16 on torch's kernel, and such a test would see torch's answer)."""
    from attnkit.backends import native

    monkeypatch.setattr(native, "_BF16_HW", False)


@pytest.fixture
def widened_bf16():
    """The compiled kernel's bf16 forward widened to fp32 per tile, also on a CPU with AMX (where by default it
    multiplies bf16 on tiles and rounds P to bf16: tests/backends/test_native_amx.py): for tests of the widening
    path's contract, bit for bit the fp32 kernel's answer on the widened inputs."""
    from attnkit.backends import _native

    if not _native.available():
        yield
        return
    before = _native.set_bf16_dot(False)
    try:
        yield
    finally:
        _native.set_bf16_dot(before)
