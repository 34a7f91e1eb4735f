"""attnkit's own compiled CPU kernel (``attnkit._native``, C++/OpenMP, ``src/attnkit/csrc``), in one place.

Block-sparse FlashAttention-2, forward and backward, built when attnkit is installed
(``pip install``, ``make demo``, ``make test``; never at the first call). Masks reach it as
per-row key intervals (:meth:`attnkit.masks.Mask.row_intervals`): row ``i`` sees keys
``lo[i] <= j < hi[i]``, so a tile is skipped, computed without a mask, or masked with two
comparisons per score — no (L, S) mask and no per-tile mask tensors::

    window(3), 4 x 4 tiles of 2      lo  hi        tile kinds for q block 1 (rows 2-3):
    q0  █ · · ·                       0   1          keys 0-1: partial (row 2 sees key 1 only)
    q1  █ █ · ·                       0   2          keys 2-3: partial (row 2 does not see key 3)
    q2  · █ █ ·                       1   3
    q3  · · █ █                       2   4

Shapes: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv); H a multiple of Hkv (GQA
without copying K/V); lo, hi (1 or B, L) int32. Computes in fp32 (bf16 / fp16 inputs are
converted on the way in, outputs rounded on the way out); lse (B, H, L) fp32 in natural-log
units; a row that sees no key gives out 0 and lse ``-inf``.

**Layout contract** (:func:`_fit`, applied to every tensor handed over): the kernel reads each
row (last dimension) as contiguous fp32 memory and any other stride as given (sliced or
transposed leading dims, stride-0 broadcasts). A tensor whose last dim has stride != 1 is copied.

**Instruction set**: AVX-512, AVX2 + FMA, or portable code (SSE2 / NEON), chosen at run time
from the CPU (:func:`isa`). ``ATTNKIT_NATIVE_ISA=avx2|base`` forces a lower one (tests run all).

**Availability** (:func:`available`): ``ATTNKIT_NATIVE=0`` switches the kernel off (no warning).
Otherwise, when the extension is missing (no compiler at install time, a failed build), the
first call that would have used it warns once and attnkit runs torch's kernels instead.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import warnings

import torch

__all__ = ["available", "unavailable_reason", "isa", "forward", "backward", "status", "release_scratch"]

ISA_NAMES = {0: "portable", 1: "AVX2", 2: "AVX-512"}
_ISA_ENV = {"base": 0, "portable": 0, "avx2": 1, "avx512": 2}

_lib: ctypes.CDLL | None = None
_why: str | None = None
_loaded = False
_warned = False


def _load() -> None:
    global _lib, _why, _loaded
    if _loaded:
        return
    _loaded = True
    if os.environ.get("ATTNKIT_NATIVE", "1").lower() in ("0", "off", "false", "no"):
        _why = "switched off by ATTNKIT_NATIVE=0"
        return
    spec = importlib.util.find_spec("attnkit._native")
    if spec is None or spec.origin is None:
        _why = ("attnkit was installed without its compiled CPU kernel (no C++ compiler with OpenMP at install "
                "time, or its build failed); reinstall with one, e.g. `apt install g++` then "
                "`pip install --force-reinstall --no-deps -e .` (or `make test`)")
        return
    try:
        lib = ctypes.CDLL(spec.origin)  # torch is imported: its libgomp (same soname) is reused
    except OSError as e:
        _why = f"attnkit's compiled CPU kernel failed to load: {e}"
        return
    lib.ak_forward.restype = None
    lib.ak_backward.restype = ctypes.c_int
    lib.ak_release_scratch.restype = None
    ptr, f32 = ctypes.c_void_p, ctypes.c_float
    lib.ak_forward.argtypes = (ptr, f32, *(ptr,) * 8)
    lib.ak_backward.argtypes = (ptr, f32, *(ptr,) * 14)
    forced = os.environ.get("ATTNKIT_NATIVE_ISA", "").lower()
    if forced:
        if forced not in _ISA_ENV:
            raise ValueError(f"ATTNKIT_NATIVE_ISA: expected one of {sorted(_ISA_ENV)}, got {forced!r}.")
        lib.ak_set_isa(_ISA_ENV[forced])
    _lib = lib


def available() -> bool:
    _load()
    return _lib is not None


def unavailable_reason() -> str:
    _load()
    return _why or ""


def warn_missing() -> None:
    """Once per process, when a call that would have run the kernel runs torch's kernels instead."""
    global _warned
    _load()
    if _lib is None and not _warned and not (_why or "").startswith("switched off"):
        _warned = True
        warnings.warn(f"attnkit: {_why}. Running torch's CPU kernels instead (exact, slower on masks).",
                      RuntimeWarning, stacklevel=3)


def isa() -> str:
    """The instruction set the kernel runs with on this machine ("AVX-512", "AVX2", "portable")."""
    _load()
    return ISA_NAMES[int(_lib.ak_isa())] if _lib is not None else "unavailable"


def status() -> str:
    """One line: the kernel and its instruction set, or why it is not used."""
    _load()
    if _lib is not None:
        return f"attnkit's compiled CPU kernel ({isa()}, OpenMP {'on' if _lib.ak_openmp() else 'off'})"
    return f"attnkit's compiled CPU kernel is not used: {unavailable_reason()}"


def set_isa(name: str) -> str:
    """Force a lower instruction set (``"base"``, ``"avx2"``, ``"avx512"``: the best this CPU has at most)."""
    _load()
    if _lib is None:
        raise RuntimeError(unavailable_reason())
    _lib.ak_set_isa(_ISA_ENV[name])
    return isa()


def _require() -> ctypes.CDLL:
    _load()
    if _lib is None:
        raise RuntimeError(unavailable_reason())
    return _lib


def _fit(t: torch.Tensor) -> torch.Tensor:
    t = t.float()
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _meta(q, k, v, lob: int) -> torch.Tensor:
    B, H, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    return torch.tensor([B, H, Hkv, L, S, D, Dv, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], lob,
                         torch.get_num_threads()], dtype=torch.int64)


def _edges(lo: torch.Tensor, hi: torch.Tensor, B: int, L: int):
    assert lo.dtype == torch.int32 and lo.shape == hi.shape and lo.shape[-1] == L and lo.shape[0] in (1, B)
    lo, hi = lo.contiguous(), hi.contiguous()
    return lo, hi, (L if lo.shape[0] == B and B > 1 else 0)


def _slopes(alibi, H: int):
    if alibi is None:
        return None
    a = alibi.detach().to(device="cpu", dtype=torch.float32).contiguous()
    assert a.shape == (H,), a.shape
    return a


def forward(q, k, v, lo, hi, scale: float, alibi=None):
    """(out (B, H, L, Dv) fp32, lse (B, H, L) fp32) of attention where row i sees keys [lo, hi);
    ``alibi``: (H,) slopes added as ``slope[h] · (kv − q)`` to each score, or None."""
    lib = _require()
    q, k, v = _fit(q), _fit(k), _fit(v)
    B, H, L, _ = q.shape
    lo, hi, lob = _edges(lo, hi, B, L)
    out = torch.empty(B, H, L, v.shape[-1])
    lse = torch.empty(B, H, L)
    meta = _meta(q, k, v, lob)
    ab = _slopes(alibi, H)
    lib.ak_forward(meta.data_ptr(), float(scale), q.data_ptr(), k.data_ptr(), v.data_ptr(), lo.data_ptr(),
                   hi.data_ptr(), None if ab is None else ab.data_ptr(), out.data_ptr(), lse.data_ptr())
    return out, lse


def backward(q, k, v, lo, hi, scale: float, out, lse, dout, dlse=None, alibi=None):
    """(dq, dk, dv) in fp32 for the forward above (``out``, ``lse`` its results); ``dlse`` a gradient
    into lse, or None. delta = rowsum(dO·O) - dlse, the sum over key tiles of dQ and the scale are
    all done inside the kernel."""
    lib = _require()
    q, k, v = _fit(q), _fit(k), _fit(v)
    dout = dout.float()  # any strides: an expanded gradient (loss.sum()) is read in place, never copied whole
    B, H, L, D = q.shape
    lo, hi, lob = _edges(lo, hi, B, L)
    out = out.float().contiguous()
    lse = lse.float().contiguous()
    dlse = None if dlse is None else dlse.float().contiguous()
    dq = torch.empty(B, H, L, D)
    dk = torch.empty(B, k.shape[1], k.shape[2], D)
    dv = torch.empty(B, v.shape[1], v.shape[2], v.shape[-1])
    meta = _meta(q, k, v, lob)
    sdo = torch.tensor(dout.stride(), dtype=torch.int64)
    ab = _slopes(alibi, H)
    rc = lib.ak_backward(meta.data_ptr(), float(scale), q.data_ptr(), k.data_ptr(), v.data_ptr(), lo.data_ptr(),
                         hi.data_ptr(), None if ab is None else ab.data_ptr(), dout.data_ptr(), sdo.data_ptr(),
                         out.data_ptr(), lse.data_ptr(),
                         None if dlse is None else dlse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    if rc != 0:
        raise MemoryError(f"attnkit's compiled kernel: no memory for the backward's scratch (B={B}, H={H}, L={L})")
    return dq, dk, dv


def release_scratch() -> None:
    """Give back the scratch memory the backward keeps between calls on this thread (δ and the
    per-block lock flags of the largest call so far: B·H·L floats). The next backward allocates it again."""
    if available():
        _require().ak_release_scratch()
