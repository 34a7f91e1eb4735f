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
TILE = 64  # the kernel's tile: 64 query rows x 64 keys (BM, BN in csrc/attn_impl.h); tile maps use it
_ISA_ENV = {"base": 0, "portable": 0, "avx2": 1, "avx512": 2}

_lib: ctypes.CDLL | None = None
_why: str | None = None
_loaded = False
_warned = False


class _Call(ctypes.Structure):
    """The kernel's call record (``AkCall`` in csrc/attn_common.h): one per call, its size and version
    checked by the kernel, so a stale build never reads arguments by the wrong position."""

    _fields_ = [*((n, ctypes.c_int64) for n in ("size", "version", "B", "H", "Hkv", "L", "S", "D", "Dv")),
                *((n, ctypes.c_int64 * 3) for n in ("sq", "sk", "sv")), ("sdo", ctypes.c_int64 * 4),
                *((n, ctypes.c_int64) for n in ("lob", "threads", "tkb", "tkh")), ("scale", ctypes.c_double),
                *((n, ctypes.c_void_p) for n in ("q", "k", "v", "lo", "hi", "alibi", "tkind", "tidx", "tbits",
                                                 "pcode")),
                *((n, ctypes.c_int64) for n in ("pn", "pregs", "pout")),
                *((n, ctypes.c_void_p) for n in ("pconsts", "ptables", "ptshape", "perr", "ptgrad")),
                ("pntables", ctypes.c_int64),
                *((n, ctypes.c_void_p) for n in ("out", "lse", "dout", "fwd_out", "fwd_lse", "dlse", "dq", "dk", "dv"))]


_ABI_VERSION = 4  # AK_ABI_VERSION in csrc/attn_common.h


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
    if hasattr(lib, "ak_abi_version"):  # a build older than the call record has neither symbol
        lib.ak_abi_size.restype = lib.ak_abi_version.restype = ctypes.c_int64
    if not hasattr(lib, "ak_abi_version") or lib.ak_abi_version() != _ABI_VERSION \
            or lib.ak_abi_size() != ctypes.sizeof(_Call):
        _why = ("attnkit's compiled CPU kernel is from another version of attnkit (its call record differs); "
                "rebuild it: `pip install --force-reinstall --no-deps -e .` (or `make test`)")
        return
    lib.ak_forward.restype = lib.ak_backward.restype = ctypes.c_int
    lib.ak_forward.argtypes = lib.ak_backward.argtypes = (ctypes.POINTER(_Call),)
    lib.ak_release_scratch.restype = None
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


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _call(q, k, v, lo, hi, scale: float, alibi, tiles, prog=None) -> tuple[_Call, list]:
    """The call record for these inputs (q, k, v already fitted); ``keep`` holds the tensors it points into."""
    B, H, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    lo, hi, lob = _edges(lo, hi, B, L)
    ab = _slopes(alibi, H)
    c = _Call(size=ctypes.sizeof(_Call), version=_ABI_VERSION, B=B, H=H, Hkv=Hkv, L=L, S=S, D=D, Dv=Dv,
              lob=lob, threads=torch.get_num_threads(), scale=float(scale))
    c.sq[:], c.sk[:], c.sv[:] = q.stride()[:3], k.stride()[:3], v.stride()[:3]
    c.q, c.k, c.v, c.alibi = q.data_ptr(), k.data_ptr(), v.data_ptr(), _ptr(ab)
    c.lo, c.hi = lo.data_ptr(), hi.data_ptr()
    keep = [q, k, v, lo, hi, ab]
    if tiles is not None:
        kinds, idx, bits = tiles.kinds, tiles.index, tiles.bits
        assert kinds.dtype == torch.int8 and idx.dtype == torch.int32 and bits.dtype == torch.int32
        assert kinds.is_contiguous() and idx.is_contiguous() and bits.is_contiguous() and kinds.shape == idx.shape
        TB, TH, nq, nk = kinds.shape
        assert TB in (1, B) and TH in (1, H) and nq == -(-L // TILE) and nk == -(-S // TILE), (kinds.shape, B, H, L, S)
        c.tkb, c.tkh = (TH * nq * nk if TB > 1 else 0), (nq * nk if TH > 1 else 0)
        c.tkind, c.tidx, c.tbits = kinds.data_ptr(), idx.data_ptr(), bits.data_ptr()
        keep += [kinds, idx, bits]
    if prog is not None:  # a traced score_mod (attnkit._scoreprog.Program)
        assert alibi is None
        code = prog.code.contiguous()
        ptrs = (ctypes.c_void_p * max(1, len(prog.tables)))(*(t.data_ptr() for t in prog.tables))
        shape = torch.tensor([[t.dim(), *t.shape, *([1] * (4 - t.dim()))] for t in prog.tables] or [[0] * 5],
                             dtype=torch.int64)
        c.pcode, c.pn, c.pregs, c.pout = code.data_ptr(), code.shape[0], prog.n_regs, prog.out
        err = torch.zeros(1, dtype=torch.int32)
        c.pconsts, c.ptables, c.ptshape = prog.consts.data_ptr(), ctypes.addressof(ptrs), shape.data_ptr()
        c.perr, c.pntables = err.data_ptr(), len(prog.tables)
        keep += [code, ptrs, shape, prog, err]
    return c, keep


def _check_reads(prog, keep) -> None:
    """IndexError where the score_mod's program read a captured tensor out of range (as torch's indexing raises)."""
    if prog is not None and int(keep[-1][0]):
        t = prog.tables[int(keep[-1][0]) - 1]
        raise IndexError(f"score_mod: an index into a captured tensor of shape {tuple(t.shape)} is out of range at "
                         "some (query, key) of this call (torch's indexing raises the same); clamp the index or "
                         "make the tensor larger")


def _check(rc: int, B: int, H: int, L: int) -> None:
    if rc == 1:
        raise MemoryError(f"attnkit's compiled kernel: no memory for the backward's scratch (B={B}, H={H}, L={L})")
    if rc != 0:
        raise RuntimeError(f"attnkit's compiled kernel refused the call (code {rc}): rebuild it "
                           "(`pip install --force-reinstall --no-deps -e .`)")


def forward(q, k, v, lo, hi, scale: float, alibi=None, tiles=None, prog=None):
    """(out (B, H, L, Dv) fp32, lse (B, H, L) fp32) of attention where row i sees keys [lo, hi) and, with
    ``tiles`` (a :class:`~attnkit.backends._tilebits.TileBits` of 64 × 64 tiles), only what its tile map
    and partial tiles' bits allow; ``alibi``: (H,) slopes added as ``slope[h] · (kv − q)``, or None; ``prog``:
    a traced score_mod (:class:`attnkit._scoreprog.Program`) run on the scaled scores, or None."""
    lib = _require()
    q, k, v = _fit(q), _fit(k), _fit(v)
    B, H, L, _ = q.shape
    c, keep = _call(q, k, v, lo, hi, scale, alibi, tiles, prog)
    out = torch.empty(B, H, L, v.shape[-1])
    lse = torch.empty(B, H, L)
    c.out, c.lse = out.data_ptr(), lse.data_ptr()
    _check(lib.ak_forward(ctypes.byref(c)), B, H, L)
    _check_reads(prog, keep)
    del keep
    return out, lse


def backward(q, k, v, lo, hi, scale: float, out, lse, dout, dlse=None, alibi=None, tiles=None, prog=None):
    """(dq, dk, dv, table grads) in fp32 for the forward above (``out``, ``lse`` its results); ``dlse`` a
    gradient into lse, or None. delta = rowsum(dO·O) - dlse, the sum over key tiles of dQ (in key-tile order:
    the same bits on every run and at every thread count) and the scale are all done inside the kernel.
    ``table grads``: per table of ``prog``, the gradient into it (fp32, the table's shape) where
    ``prog.grad_of`` names a tensor that wants one, else None (an empty list without a program)."""
    lib = _require()
    q, k, v = _fit(q), _fit(k), _fit(v)
    dout = dout.float()  # any strides: an expanded gradient (loss.sum()) is read in place, never copied whole
    B, H, L, D = q.shape
    c, keep = _call(q, k, v, lo, hi, scale, alibi, tiles, prog)
    out = out.float().contiguous()
    lse = lse.float().contiguous()
    dlse = None if dlse is None else dlse.float().contiguous()
    dq = torch.empty(B, H, L, D)
    dk = torch.empty(B, k.shape[1], k.shape[2], D)
    dv = torch.empty(B, v.shape[1], v.shape[2], v.shape[-1])
    c.sdo[:] = dout.stride()
    c.dout, c.fwd_out, c.fwd_lse, c.dlse = dout.data_ptr(), out.data_ptr(), lse.data_ptr(), _ptr(dlse)
    c.dq, c.dk, c.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    tgrads: list = []
    if prog is not None and prog.wants_grads:
        tgrads = [None if src is None else torch.zeros(t.shape) for t, src in zip(prog.tables, prog.grad_of,
                                                                                    strict=True)]
        gptrs = (ctypes.c_void_p * len(tgrads))(*(None if g is None else g.data_ptr() for g in tgrads))
        c.ptgrad = ctypes.addressof(gptrs)
        keep += [gptrs]
    _check(lib.ak_backward(ctypes.byref(c)), B, H, L)
    del keep
    return dq, dk, dv, tgrads


def release_scratch() -> None:
    """Give back the scratch memory the backward keeps between calls on this thread (δ, the per-block
    dQ turns and key-tile ranges of the largest call so far: about B·H·L floats). The next backward
    allocates it again."""
    if available():
        _require().ak_release_scratch()
