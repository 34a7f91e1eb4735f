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
without copying K/V); lo, hi (1 or B, L) int32. Computes in fp32: bf16 / fp16 inputs (q, k, v
and dO of one dtype) are read as they are and widened tile by tile inside the kernel, never
converted whole; outputs are fp32, or rounded to the inputs' dtype by the kernel itself where the
caller asks (``rounded``: the bits of ``.to(dtype)``, without a pass of its own over the output);
lse (B, H, L) fp32 in natural-log units; a row that sees no key gives out 0 and lse ``-inf``.

**Layout contract** (:func:`_fit`, applied to every tensor handed over): the kernel reads each
row (last dimension) as contiguous memory and any other stride as given (sliced or
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
import threading
import warnings
from collections.abc import Callable

import torch

__all__ = ["available", "unavailable_reason", "isa", "forward", "backward", "decode", "status", "release_scratch"]

ISA_NAMES = {0: "portable", 1: "AVX2", 2: "AVX-512"}
TILE = 64  # the kernel's tile: 64 query rows x 64 keys (BM, BN in csrc/attn_impl.h); tile maps use it
_ISA_ENV = {"base": 0, "portable": 0, "avx2": 1, "avx512": 2}


def _isa_level(name, arg: str) -> int:
    """The level of an instruction set named as :func:`set_isa` / ``ATTNKIT_NATIVE_ISA`` take it, or as
    :func:`isa` prints it ("AVX-512" = "avx512"): case and hyphens ignored."""
    key = name.lower().replace("-", "") if isinstance(name, str) else None
    if key not in _ISA_ENV:
        raise ValueError(f"{arg}: expected an instruction set, one of {sorted(_ISA_ENV)} (or a name isa() returns: "
                         f"{sorted(ISA_NAMES.values())}), got {name!r}. Use one of those, or leave it unset for "
                         "the best this CPU has.")
    return _ISA_ENV[key]

_lib: ctypes.CDLL | None = None
_why: str | None = None
_loaded = False
# the same .so imported as a Python module: its vectorcalls `step` and `suspect_rows` (a replayed call's hot path,
# without ctypes' per-argument conversion), or None (a build from before them: the ctypes entries instead)
_ext = None
_ENTRY = {"ak_forward": 0, "ak_decode": 2}
_warned = False


class _Call(ctypes.Structure):
    """The kernel's call record (``AkCall`` in csrc/attn_common.h): one per call, its size and version
    checked by the kernel, so a stale build never reads arguments by the wrong position."""

    _fields_ = [*((n, ctypes.c_int64) for n in ("size", "version", "B", "H", "Hkv", "L", "D", "Dv")),
                ("sq", ctypes.c_int64 * 3),
                # the block a decode step rewrites (S, K / V strides, pointers, outputs): contiguous, in this order
                ("S", ctypes.c_int64), ("sk", ctypes.c_int64 * 3), ("sv", ctypes.c_int64 * 3),
                *((n, ctypes.c_void_p) for n in ("q", "k", "v", "lo", "hi", "out", "lse")),
                ("sdo", ctypes.c_int64 * 4),
                *((n, ctypes.c_int64) for n in ("lob", "threads", "tkb", "tkh", "dtype", "chunk")),
                ("scale", ctypes.c_double),
                *((n, ctypes.c_void_p) for n in ("alibi", "tkind", "tidx", "tbits", "pcode")),
                *((n, ctypes.c_int64) for n in ("pn", "pregs", "pout")),
                *((n, ctypes.c_void_p) for n in ("pconsts", "ptables", "ptshape", "perr", "ptgrad")),
                ("pntables", ctypes.c_int64),
                *((n, ctypes.c_void_p) for n in ("dout", "fwd_out", "fwd_lse", "dlse", "dq", "dk", "dv")),
                ("nst", ctypes.c_int64), ("lst", ctypes.c_int64),
                ("ort", ctypes.c_int64), ("out_r", ctypes.c_void_p), ("grads_r", ctypes.c_int64),
                ("order", ctypes.c_int64)]


# every buffer the kernel writes is allocated with its dtype and device named: torch's defaults are the user's
# (``torch.set_default_dtype(torch.float64)`` made fp32 outputs float64 buffers the kernel wrote fp32 into — a wrong
# answer; a default device made them another device's memory)
_CPU = torch.device("cpu")
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1  # a row interval given as ints, saturated (the kernel clamps to [0, S])
_ABI_VERSION = 10  # AK_ABI_VERSION in csrc/attn_common.h
MAX_PLANES = 8  # AK_MAX_STRETCHES: the stretch planes a decode call may bring (lo / hi (n, 1 or B, L))


def _load() -> None:
    global _lib, _why, _loaded
    if _loaded:
        return
    # a bad ATTNKIT_NATIVE_ISA is refused before anything is marked loaded: every call says so (marked first, the
    # second call found the kernel "unavailable" with no reason and ran torch's kernels without a word)
    forced = os.environ.get("ATTNKIT_NATIVE_ISA", "")
    level = _isa_level(forced, "ATTNKIT_NATIVE_ISA") if forced else None
    bdot = os.environ.get("ATTNKIT_NATIVE_BF16_DOT", "1").strip().lower()
    if bdot not in _SWITCH_WORDS:
        raise ValueError(f"ATTNKIT_NATIVE_BF16_DOT: expected one of {sorted(_SWITCH_WORDS)}, got {bdot!r}. Use 0 to "
                         "widen bf16 to fp32 per tile on every CPU, or leave it unset (bf16 dot products where the "
                         "CPU has them)")
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
    lib.ak_forward.restype = lib.ak_backward.restype = lib.ak_decode.restype = ctypes.c_int
    lib.ak_forward.argtypes = lib.ak_backward.argtypes = lib.ak_decode.argtypes = (ctypes.POINTER(_Call),)
    lib.ak_release_scratch.restype = None
    if hasattr(lib, "ak_suspect_rows"):  # (a build from before it: the caller's torch reduction instead)
        lib.ak_suspect_rows.restype = ctypes.c_int
        lib.ak_suspect_rows.argtypes = (ctypes.c_void_p, ctypes.c_int, *([ctypes.c_int64] * 8), ctypes.c_int)
    if hasattr(lib, "ak_dense_tiles"):  # (a build from before it: torch ops read the mask's tiles instead)
        lib.ak_dense_tiles.restype = ctypes.c_int64
        lib.ak_dense_tiles.argtypes = (ctypes.c_void_p, *([ctypes.c_int64] * 8), *([ctypes.c_void_p] * 3),
                                       ctypes.c_int64)
    if hasattr(lib, "ak_tile_rows"):
        lib.ak_tile_rows.restype = ctypes.c_int
        lib.ak_tile_rows.argtypes = (*([ctypes.c_void_p] * 3), *([ctypes.c_int64] * 3), *([ctypes.c_void_p] * 2))
    global _ext
    try:
        mod = importlib.import_module("attnkit._native")
    except ImportError:  # (loaded above by ctypes: a failure here is not expected; the ctypes entries serve)
        mod = None
    _ext = mod if hasattr(mod, "step") and hasattr(mod, "suspect_rows") else None
    if level is not None:
        lib.ak_set_isa(level)
    if hasattr(lib, "ak_set_bf16_dot"):
        lib.ak_set_bf16_dot(int(_SWITCH_WORDS[bdot]))
    _lib = lib


_SWITCH_WORDS = {"1": True, "on": True, "true": True, "yes": True, "0": False, "off": False, "false": False,
                 "no": False}


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
        bdot = ", bf16 on AMX tiles" if bf16_dot() else ""
        bdot += ", bf16 decode dot products" if bf16_vdot() else ""
        return f"attnkit's compiled CPU kernel ({isa()}{bdot}, OpenMP {'on' if _lib.ak_openmp() else 'off'})"
    return f"attnkit's compiled CPU kernel is not used: {unavailable_reason()}"


def set_isa(name: str) -> str:
    """Force a lower instruction set (``"base"``, ``"avx2"``, ``"avx512"``, or a name :func:`isa` returns: the best
    this CPU has at most); returns the one now in use, as :func:`isa` names it (so ``set_isa(isa())`` restores)."""
    _load()
    if _lib is None:
        raise RuntimeError(unavailable_reason())
    _lib.ak_set_isa(_isa_level(name, "name"))
    return isa()


def bf16_dot() -> bool:
    """Whether a bf16 forward multiplies bf16 itself on AMX tiles (fp32 accumulation, P rounded to bf16 once per
    tile; D not a multiple of 32: the scores' depth zero-padded to one; docs/kernel.md) rather than widening to fp32
    per tile: the AVX-512 build, on a CPU with AMX, unless switched off (:func:`set_bf16_dot`,
    ``ATTNKIT_NATIVE_BF16_DOT=0``). The backward multiplies on tiles where D and Dv are multiples of 16; a decode unit
    of 2 to 16 rows (a GQA group) takes its scores on tiles too."""
    _load()
    return _lib is not None and hasattr(_lib, "ak_bf16_dot_active") and bool(_lib.ak_bf16_dot_active())


def bf16_vdot() -> bool:
    """Whether a bf16 decode (a call of at most 64 query rows per kv head, and its few-rows backward) takes its
    scores by avx512_bf16's vector dot products (VDPBF16PS: fp32 sums of exact bf16 products, in pairs) rather than
    widening each key to fp32: the AVX-512 build, on a CPU with avx512_bf16 (AMX or not), unless switched off with
    the same setting as :func:`bf16_dot`. Where :func:`bf16_dot` is on too, a unit of 2 to 16 rows takes them on AMX
    tiles instead (the same fp32 sums of exact products, in another order)."""
    _load()
    return _lib is not None and hasattr(_lib, "ak_bf16_vdot_active") and bool(_lib.ak_bf16_vdot_active())


def set_bf16_dot(on: bool) -> bool:
    """Switch the kernel's bf16 products on (where the CPU has them: the forward's and backward's AMX tiles, the
    decode's vector dot products) or off (bf16 widened to fp32 per tile, as on every other CPU, bit for bit the fp32
    kernel's answer on the widened values); returns the previous setting."""
    lib = _require()
    if not hasattr(lib, "ak_set_bf16_dot"):
        raise RuntimeError("this build of the compiled kernel has no bf16 dot products; rebuild it (`make test`)")
    before = bool(lib.ak_bf16_dot_get()) if hasattr(lib, "ak_bf16_dot_get") else True
    lib.ak_set_bf16_dot(int(bool(on)))
    return before


def learned_read_orders() -> tuple[int, int]:
    """The decode's read orders learned so far in this process (csrc/attn_common.h, ``ak_order_choice``): where a
    record leaves the order to the rule ("rule": no calibration) and the rule would read K and V in memory order, the
    kernel times both orders on a call shape's first calls and keeps the faster. Returns (call shapes decided, of them
    in memory order)."""
    lib = _require()
    if not hasattr(lib, "ak_decode_learned"):
        raise RuntimeError("this build of the compiled kernel learns no read order; rebuild it (`make test`)")
    n = int(lib.ak_decode_learned())
    return n // 1024, n % 1024


def set_read_order_learning(on: bool, forget: bool = False) -> bool:
    """Whether the decode learns its read order where the rule would read in memory order (on: the default; off: the
    rule itself, memory order from 8 MB); ``forget``: drop what was learned. Returns the previous setting."""
    lib = _require()
    if not hasattr(lib, "ak_set_decode_learn"):
        raise RuntimeError("this build of the compiled kernel learns no read order; rebuild it (`make test`)")
    before = bool(lib.ak_set_decode_learn(-1))
    lib.ak_set_decode_learn(int(bool(on)))
    if forget:
        lib.ak_decode_learn_reset()
    return before


def _require() -> ctypes.CDLL:
    _load()
    if _lib is None:
        raise RuntimeError(unavailable_reason())
    return _lib


def _fit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _fit_all(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``ts`` as the kernel reads them: as they are where they share one of its dtypes (fp32, bf16, fp16: widened
    per tile inside), else all in fp32; each with its last dimension contiguous."""
    if ts[0].dtype not in _DTYPE_CODE or any(t.dtype != ts[0].dtype for t in ts):
        ts = tuple(t.float() for t in ts)
    return tuple(_fit(t) for t in ts)


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
    c = _Call(size=ctypes.sizeof(_Call), version=_ABI_VERSION, B=B, H=H, Hkv=Hkv, L=L, S=S, D=D, Dv=Dv,
              lob=lob, threads=torch.get_num_threads(), scale=float(scale), dtype=_DTYPE_CODE[q.dtype])
    c.sq[:], c.sk[:], c.sv[:] = q.stride()[:3], k.stride()[:3], v.stride()[:3]
    c.q, c.k, c.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    c.lo, c.hi = lo.data_ptr(), hi.data_ptr()
    keep = [q, k, v, lo, hi]
    if tiles is not None:
        kinds, idx, bits = tiles.kinds, tiles.index, tiles.bits
        assert kinds.dtype == torch.int8 and idx.dtype == torch.int32 and bits.dtype == torch.int32
        assert kinds.is_contiguous() and idx.is_contiguous() and bits.is_contiguous() and kinds.shape == idx.shape
        TB, TH, nq, nk = kinds.shape
        assert TB in (1, B) and TH in (1, H) and nq == -(-L // TILE) and nk == -(-S // TILE), (kinds.shape, B, H, L, S)
        c.tkb, c.tkh = (TH * nq * nk if TB > 1 else 0), (nq * nk if TH > 1 else 0)
        c.tkind, c.tidx, c.tbits = kinds.data_ptr(), idx.data_ptr(), bits.data_ptr()
        keep += [kinds, idx, bits]
    return c, keep + _score_parts(c, H, alibi, prog)


def _score_parts(c: _Call, H: int, alibi, prog) -> list:
    """Point the record ``c`` at ALiBi's (H,) slopes or a score_mod's program (its code, constants, tables and an
    out-of-range flag, last in the returned list: :func:`_check_reads` reads it); returns what it points into."""
    ab = _slopes(alibi, H)
    c.alibi = _ptr(ab)
    keep: list = [ab]
    if prog is not None:  # a traced score_mod (attnkit._scoreprog.Program)
        assert alibi is None
        code = prog.code.contiguous()
        ptrs = (ctypes.c_void_p * max(1, len(prog.tables)))(*(t.data_ptr() for t in prog.tables))
        shape = torch.tensor([[t.dim(), *t.shape, *([1] * (4 - t.dim()))] for t in prog.tables] or [[0] * 5],
                             dtype=torch.int64, device=_CPU)
        c.pcode, c.pn, c.pregs, c.pout = code.data_ptr(), code.shape[0], prog.n_regs, prog.out
        err = torch.zeros(1, dtype=torch.int32, device=_CPU)
        c.pconsts, c.ptables, c.ptshape = prog.consts.data_ptr(), ctypes.addressof(ptrs), shape.data_ptr()
        c.perr, c.pntables = err.data_ptr(), len(prog.tables)
        keep += [code, ptrs, shape, prog, err]
    return keep


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


def forward(q, k, v, lo, hi, scale: float, alibi=None, tiles=None, prog=None, rounded: bool = False):
    """(out (B, H, L, Dv) fp32, lse (B, H, L) fp32, out_r) of attention where row i sees keys [lo, hi) and, with
    ``tiles`` (a :class:`~attnkit.backends._tilebits.TileBits` of 64 × 64 tiles), only what its tile map
    and partial tiles' bits allow; ``alibi``: (H,) slopes added as ``slope[h] · (kv − q)``, or None; ``prog``:
    a traced score_mod (:class:`attnkit._scoreprog.Program`) run on the scaled scores, or None.
    ``out_r``: with ``rounded`` and bf16 / fp16 inputs, out in their dtype, written by the kernel from its fp32
    rows (the bits of ``out.to(q.dtype)``, without that pass over the output); else None."""
    lib = _require()
    q, k, v = _fit_all(q, k, v)
    B, H, L, _ = q.shape
    c, keep = _call(q, k, v, lo, hi, scale, alibi, tiles, prog)
    out = torch.empty(B, H, L, v.shape[-1], dtype=torch.float32, device=_CPU)
    lse = torch.empty(B, H, L, dtype=torch.float32, device=_CPU)
    out_r = (torch.empty(B, H, L, v.shape[-1], dtype=q.dtype, device=_CPU) if rounded and q.dtype is not torch.float32
             else None)
    c.out, c.lse, c.out_r = out.data_ptr(), lse.data_ptr(), _ptr(out_r)
    _check(lib.ak_forward(ctypes.byref(c)), B, H, L)
    _check_reads(prog, keep)
    del keep
    return out, lse, out_r


def forward_step(q, k, v, lo, hi, tiles=None, alibi=None, prog=None, with_lse=False, rounded=False,
                 beside: bool = False):
    """The forward of one call signature prepared once, for calls without gradients (:mod:`attnkit._fast`):
    returns ``run(q, k, v, scale) -> out`` ((B, H, L, Dv) fp32), for inputs of the shapes and dtypes of these
    ``q, k, v`` at any strides. The call record (shapes, dtype, threads, the mask's rows ``lo`` / ``hi`` and tile
    map, ALiBi's slopes or a score_mod's program, which the prepared call keeps) is built here; a call writes only
    the strides, pointers, outputs and scale into it (one record per thread: ctypes releases the GIL during the
    kernel). ``with_lse``: ``run`` returns ``(out, lse (B, H, L) fp32)``. ``rounded``: out in q's dtype, rounded
    by the kernel from its fp32 rows (bf16 / fp16: no fp32 output and no conversion pass), not fp32. ``beside``
    (bf16 / fp16, with ``with_lse``): ``run`` returns ``(out fp32, lse, out in q's dtype)``, the second output
    rounded by the kernel from the first's rows (the bits of ``out.to(q.dtype)``, without that pass)."""
    lib = _require()
    q, k, v = _fit_all(q, k, v)
    c0, keep = _call(q, k, v, lo, hi, 1.0, alibi, tiles, prog)
    c0.ort = int(rounded and q.dtype is not torch.float32)
    # lo, hi (as the record points at them), the slopes, tile map and program: not the first call's q, k, v
    return _stepper(lib.ak_forward, c0, keep[3:], q, k, v, need_lse=True, prog=prog, with_lse=with_lse,
                    rows=tuple(keep[3].shape), beside=beside)


def decode_step(q, k, v, lo, hi, chunk: int = 0, alibi=None, prog=None, with_lse: bool = False,
                rounded: bool = False, order: str | None = None, beside: bool = False):
    """:func:`decode` for one call signature prepared once (as :func:`forward_step`): returns ``run(q, k, v,
    scale) -> out`` ((B, H, L, Dv) fp32; with ``rounded``, in q's dtype, as :func:`decode`) for inputs of these
    shapes and dtypes at any strides. ``alibi`` / ``prog``: as :func:`decode` (kept by the prepared call).
    ``with_lse``: ``run`` returns ``(out, lse)``. ``order``: as :func:`decode` (asked here, once). ``beside``: as
    :func:`forward_step`'s (``run`` returns ``(out fp32, lse, out in q's dtype)``).
    ``run(q, k, v, scale, lo, hi)`` takes a cache of any length S with that call's row intervals (of the shapes of
    these ``lo`` / ``hi``; a program's ``max_s`` bounds S: the caller checks it)."""
    lib = _require()
    c0 = _decode_call(q, k, v, lo, hi, 1.0, chunk, torch.get_num_threads(), order)
    c0.ort = int(rounded and q.dtype is not torch.float32)
    if v.shape[2] != k.shape[2] or not (lo.is_contiguous() and hi.is_contiguous()):
        raise ValueError(f"decode: k and v must hold the same S keys and lo / hi be contiguous; got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    c0.lo, c0.hi = lo.data_ptr(), hi.data_ptr()
    keep = [lo, hi, *_score_parts(c0, q.shape[1], alibi, prog)]
    return _stepper(lib.ak_decode, c0, keep, q, k, v, need_lse=with_lse, prog=prog, with_lse=with_lse, any_s=True,
                    rows=tuple(lo.shape), beside=beside,
                    span_rows=q.shape[2] if lo.dim() == 2 and lo.shape[0] == 1 else 0)


def _own_record(template: bytes, prog) -> tuple[_Call, ctypes.c_int32 | None]:
    """A thread's copy of a prepared call record (``template``: its bytes) and, with a score_mod's ``prog``, the
    copy's own out-of-range flag (cleared before each call and read after it: an index computed from the score can
    leave a captured tensor on one call and not another)."""
    c = _Call.from_buffer_copy(template)
    err = None
    if prog is not None:
        err = ctypes.c_int32(0)
        c.perr = ctypes.addressof(err)
    return c, err


def _stepper(entry, c0: _Call, keep: list, q, k, v, need_lse: bool, prog=None, with_lse: bool = False,
             any_s: bool = False, span_rows: int = 0, rows: tuple = (), beside: bool = False):
    """The per-call part of :func:`forward_step` / :func:`decode_step`: a copy of the record ``c0`` per thread,
    into which each call writes q's strides, then the step block (S, K / V strides, the pointers, the outputs):
    with the extension's ``step`` (one vectorcall writes the slots and runs the same entry, the GIL released), else
    through ctypes (the slots, then ``entry``).
    With a score_mod's ``prog`` each thread's record gets its own out-of-range flag, cleared before each call and
    read after it (an index computed from the score can leave a captured tensor on one call and not another).
    Returned, where the extension has it, as its C ``Stepper`` (csrc/attn_dispatch.cpp): the same call's checks,
    strides, pointers, outputs and record in one vectorcall, the record copied onto each call's own stack (no
    per-thread state), an unread lse on that call's heap; what it was not prepared for (another dtype or S, a last
    stride other than 1, lo / hi of another shape, keywords) goes to the Python ``run`` below, its ``fallback``. At a
    decode step over 128 keys its work around the kernel costs about what torch's bindings take to read the call's
    three tensors and allocate its output, timed alone (``benchmarks/call_layers.py``).
    ``any_s`` (the decode entry): a call may bring any number of keys S (with its own ``lo`` / ``hi``).
    ``span_rows`` (a decode record of one interval row per query, lo / hi of shape (1, L)): a call may bring
    ``lo`` / ``hi`` as two ints, one interval for all ``span_rows`` rows, which it writes into its thread's own
    int32 buffer (no tensors built per call: 15.4 against 27.4 µs for a decode step over 128 keys on a 2-core AMD
    EPYC, ``benchmarks/call_costs.py``). ``beside``: a bf16 / fp16 record with an fp32 out also writes out rounded
    to q's dtype (``out_r``); ``run`` returns ``(out, lse, out_r)``."""
    if beside and (c0.ort or q.dtype is torch.float32 or not with_lse):
        raise ValueError("beside: a rounded copy beside an fp32 out, for bf16 / fp16 inputs with lse")
    B, H, L, _ = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    template = bytes(c0)
    dt = q.dtype
    oshape, lshape = (B, H, L, Dv), (B, H, L)
    odt = dt if c0.ort else torch.float32  # (the record says which: out rounded to q's dtype by the kernel, or fp32)
    first = _Call.sq.offset // 8  # sq, then the step block (S .. lse): 17 slots
    n_slots = ctypes.sizeof(_Call) // 8
    tls = threading.local()
    lo_p, hi_p = c0.lo, c0.hi

    def record():
        c, err = _own_record(template, prog)
        r = tls.r = ((ctypes.c_int64 * n_slots).from_buffer(c), ctypes.byref(c), c, err, ctypes.addressof(c))
        if span_rows:  # this thread's lo / hi rows for a call that brings its interval as two ints
            buf = (ctypes.c_int32 * (2 * span_rows))()
            tls.span = (buf, ctypes.addressof(buf), ctypes.addressof(buf) + 4 * span_rows)
        return r

    step = _ext.step if _ext is not None else None
    code = _ENTRY[entry.__name__]

    def run(q, k, v, scale: float, lo=None, hi=None):
        """``lo`` / ``hi``: this call's row intervals (the shapes of the prepared ones, contiguous), or the
        prepared ones."""
        if q.dtype is not dt or k.dtype is not dt or v.dtype is not dt:  # the signature fixes them: a misuse
            raise TypeError(f"attnkit's compiled kernel: prepared for {dt}; got {q.dtype}, {k.dtype}, {v.dtype}")
        sk = k.shape[2]
        if (sk != S and not any_s) or v.shape[2] != sk:  # the forward's tile map is for S keys
            raise ValueError(f"attnkit's compiled kernel: prepared for S = {S} keys (k and v alike); got k "
                             f"{tuple(k.shape)}, v {tuple(v.shape)}")
        qs, ks, vs = q.stride(), k.stride(), v.stride()
        if qs[3] != 1 or ks[3] != 1 or vs[3] != 1:
            q, k, v = _fit(q), _fit(k), _fit(v)
            qs, ks, vs = q.stride(), k.stride(), v.stride()
        try:
            slots, ref, c, err, addr = tls.r
        except AttributeError:
            slots, ref, c, err, addr = record()
        c.scale = scale
        out = torch.empty(*oshape, dtype=odt, device=_CPU)  # (the sizes as arguments: parsed faster than one tuple)
        lse = torch.empty(*lshape, dtype=torch.float32, device=_CPU) if need_lse else None
        if beside:
            out_r = torch.empty(*oshape, dtype=dt, device=_CPU)
            c.out_r = out_r.data_ptr()
        if err is not None:
            err.value = 0
        if lo is None:
            lp, hp = lo_p, hi_p
        elif type(lo) is int:  # one interval [lo, hi) for every row: written into this thread's own rows
            if not span_rows:
                raise TypeError("attnkit's compiled kernel: lo / hi as ints need a record prepared with (1, L) rows")
            buf, lp, hp = tls.span
            lo, hi = min(max(lo, _I32_MIN), _I32_MAX), min(max(hi, _I32_MIN), _I32_MAX)  # (ctypes would wrap them)
            buf[:] = (lo,) * span_rows + (hi,) * span_rows
        else:  # (the kernel reads as many rows as the record was prepared for: checked, never read past)
            if lo.shape != rows or hi.shape != rows or lo.dtype is not torch.int32 or hi.dtype is not torch.int32 or \
                    not (lo.is_contiguous() and hi.is_contiguous()):
                raise ValueError(f"attnkit's compiled kernel: lo / hi must be contiguous int32 of the prepared shape "
                                 f"{rows}; got {lo.dtype} {tuple(lo.shape)}, {hi.dtype} {tuple(hi.shape)}")
            lp, hp = lo.data_ptr(), hi.data_ptr()
        if step is not None:
            rc = step(code, addr, first, qs[0], qs[1], qs[2], sk, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                      q.data_ptr(), k.data_ptr(), v.data_ptr(), lp, hp, out.data_ptr(),
                      0 if lse is None else lse.data_ptr())
        else:
            slots[first:first + 17] = (qs[0], qs[1], qs[2], sk, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                                       q.data_ptr(), k.data_ptr(), v.data_ptr(), lp, hp, out.data_ptr(),
                                       0 if lse is None else lse.data_ptr())
            rc = entry(ref)
        if rc:
            raise (MemoryError if rc == 1 else RuntimeError)(f"attnkit's compiled kernel refused the call (code {rc}; "
                                                             f"1: no memory for its scratch)")
        if err is not None and err.value:
            _check_reads(prog, [(err.value,)])
        if beside:
            return out, lse, out_r
        return (out, lse) if with_lse else out

    run.keep = keep  # type: ignore[attr-defined]  # what the record points into lives as long as the call
    if _ext is None or not hasattr(_ext, "stepper"):
        return run
    # the same call in C (csrc/attn_dispatch.cpp, Stepper): the checks, strides, pointers, outputs and record of a
    # call as prepared, in one vectorcall; anything else (another dtype or S, a last stride other than 1, lo / hi of
    # another shape) goes to ``run`` above, which fits the inputs or names what is wrong
    r0, r1 = rows if len(rows) == 2 else (-1, -1)
    return _ext.stepper(template, code, -1 if any_s else S, B, H, L, Dv, r0, r1, span_rows, int(need_lse),
                        int(with_lse), int(beside), int(prog is not None), dt, odt, torch.float32, torch.int32,
                        torch.empty, run, lambda e: _check_reads(prog, [(e,)]), keep, _CPU)


def backward(q, k, v, lo, hi, scale: float, out, lse, dout, dlse=None, alibi=None, tiles=None, prog=None,
             rounded: bool = False):
    """(dq, dk, dv, table grads) in fp32 for the forward above (``out``, ``lse`` its results) — with ``rounded``,
    dq, dk, dv in q's dtype where q, k, v and dout are all bf16 / fp16 (summed in fp32, rounded once by the kernel:
    the bits of ``dq.to(q.dtype)``, without that pass); ``dlse`` a
    gradient into lse, or None. delta = rowsum(dO·O) - dlse, the sum over key tiles of dQ (in key-tile order:
    the same bits on every run and at every thread count) and the scale are all done inside the kernel.
    ``table grads``: per table of ``prog``, the gradient into it (fp32, the table's shape) where
    ``prog.grad_of`` names a tensor that wants one, else None (an empty list without a program)."""
    lib = _require()
    # dout at any strides: an expanded gradient (loss.sum()) is read in place, never copied whole
    q, k, v = _fit_all(q, k, v)
    if dout.dtype != q.dtype:  # one dtype for all four (a gradient in another dtype: all of them in fp32)
        q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
    B, H, L, D = q.shape
    c, keep = _call(q, k, v, lo, hi, scale, alibi, tiles, prog)
    out = out.float().contiguous()
    lse = lse.float().contiguous()
    dlse = None if dlse is None else dlse.float().contiguous()
    gdt = q.dtype if rounded else torch.float32  # (q's dtype here: dout's, or all fp32 above)
    c.grads_r = int(gdt is not torch.float32)
    dq = torch.empty(B, H, L, D, dtype=gdt, device=_CPU)
    dk = torch.empty(B, k.shape[1], k.shape[2], D, dtype=gdt, device=_CPU)
    dv = torch.empty(B, v.shape[1], v.shape[2], v.shape[-1], dtype=gdt, device=_CPU)
    c.sdo[:] = dout.stride()
    c.dout, c.fwd_out, c.fwd_lse, c.dlse = dout.data_ptr(), out.data_ptr(), lse.data_ptr(), _ptr(dlse)
    c.dq, c.dk, c.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    tgrads: list = []
    if prog is not None and prog.wants_grads:
        tgrads = [None if src is None else torch.zeros(t.shape, dtype=torch.float32, device=_CPU)
                  for t, src in zip(prog.tables, prog.grad_of, strict=True)]
        gptrs = (ctypes.c_void_p * len(tgrads))(*(None if g is None else g.data_ptr() for g in tgrads))
        c.ptgrad = ctypes.addressof(gptrs)
        keep += [gptrs]
    _check(lib.ak_backward(ctypes.byref(c)), B, H, L)
    del keep
    return dq, dk, dv, tgrads


def backward_step(q, k, v, lo, hi, tiles=None, alibi=None, prog=None, rounded: bool = False):
    """:func:`backward` for one call signature prepared once (as :func:`forward_step` for the forward): returns
    ``run(q, k, v, out, lse, dout, scale) -> (dq, dk, dv)`` for inputs of the shapes and dtype of these ``q, k, v``
    at any strides, ``out`` / ``lse`` the forward's fp32 results (contiguous), ``dout`` in q's dtype at any strides,
    no gradient into lse. The call record (shapes, dtype, threads, the mask's rows ``lo`` / ``hi`` and tile map,
    ALiBi's slopes or a score_mod's program, which the prepared call keeps) is built here, one copy per thread; a
    call writes only the strides, pointers and scale into it. ``rounded``: dq, dk, dv in q's dtype (bf16 / fp16:
    summed in fp32, rounded once by the kernel), else fp32. A program whose tables want gradients is refused (the
    table gradients are :func:`backward`'s). :func:`backward` builds the record and checks its arguments on every
    call: at a decode step's size (one query over 128 keys, 8 heads over 2, D = 64, fp32) 42.3 µs a call against this
    one's 33.1 on an Intel Xeon with AMX, 2 threads (``benchmarks/grad_step_costs.py``)."""
    lib = _require()
    if prog is not None and prog.wants_grads:
        raise ValueError("backward_step: a score_mod program whose tables want gradients runs backward() instead")
    q, k, v = _fit_all(q, k, v)
    dt = q.dtype
    B, H, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    c0, keep = _call(q, k, v, lo, hi, 1.0, alibi, tiles, prog)
    gdt = dt if rounded else torch.float32
    c0.grads_r = int(gdt is not torch.float32)
    c0.dlse = None
    template = bytes(c0)
    keep = keep[3:]  # lo, hi (as the record points at them), the tile map, slopes, program: not this call's q, k, v
    tls = threading.local()
    qshape, kshape, vshape, oshape = (B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, Dv), (B, H, L, Dv)

    def record():
        c, err = _own_record(template, prog)
        tls.r = r = (c, ctypes.byref(c), err)
        return r

    def run(q, k, v, out, lse, dout, scale: float):
        if q.dtype is not dt or k.dtype is not dt or v.dtype is not dt or dout.dtype is not dt:
            raise TypeError(f"attnkit's compiled kernel: backward prepared for {dt}; got q, k, v, dout in {q.dtype}, "
                            f"{k.dtype}, {v.dtype}, {dout.dtype}")
        if q.shape != qshape or k.shape != kshape or v.shape != vshape or dout.shape != oshape:
            raise ValueError(f"attnkit's compiled kernel: backward prepared for q {qshape}, k {kshape}, v {vshape}, "
                             f"dout {oshape}; "
                             f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, dout {tuple(dout.shape)}")
        if out.dtype is not torch.float32 or lse.dtype is not torch.float32 or not out.is_contiguous() \
                or not lse.is_contiguous():
            raise ValueError("attnkit's compiled kernel: the backward reads the forward's fp32 out and lse, "
                             "contiguous")
        q, k, v = _fit(q), _fit(k), _fit(v)
        try:
            c, ref, err = tls.r
        except AttributeError:
            c, ref, err = record()
        c.scale = scale
        c.sq[:], c.sk[:], c.sv[:], c.sdo[:] = q.stride()[:3], k.stride()[:3], v.stride()[:3], dout.stride()
        dq = torch.empty(*qshape, dtype=gdt, device=_CPU)
        dk = torch.empty(*kshape, dtype=gdt, device=_CPU)
        dv = torch.empty(*vshape, dtype=gdt, device=_CPU)
        c.q, c.k, c.v, c.dout = q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr()
        c.fwd_out, c.fwd_lse = out.data_ptr(), lse.data_ptr()
        c.dq, c.dk, c.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
        if err is not None:
            err.value = 0
        _check(lib.ak_backward(ref), B, H, L)
        if err is not None and err.value:
            _check_reads(prog, [(err.value,)])
        return dq, dk, dv

    run.keep = keep  # type: ignore[attr-defined]  # what the record points into lives as long as the call
    return run


_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DECODE_MAX_L = 64  # query rows per head that :func:`decode` takes (the kernel's query block)
# The decode entry's read orders of K and V (AkCall::order): "rule" — register-blocked below 8 MB of K and V (measured
# faster there on an AMD EPYC, where K and V sit in its caches), and from 8 MB in units of up to 8 rows
# the order learned per call shape on its first calls (the kernel times both and keeps the faster:
# learned_read_orders; where the learning is switched off, memory order, which won there on an AMD EPYC, Zen 3, and
# lost on the Xeon); "blocked" — register-blocked at every size; "memory" — memory order wherever the units allow.
# Both orders give the same bits.
READ_ORDERS = {"rule": 0, "blocked": 1, "memory": 2}
# the rule's line (STREAM_BYTES, FEW_ROWS in csrc/attn_decode.h): memory order for units of at most this many query
# rows (a kv head's g · L) over K and V of at least this many bytes
STREAM_ROWS, STREAM_BYTES = 8, 8 << 20


def _rule_order(threads: int) -> str:
    return "rule"


# The read order a new decode record carries at a thread count (one of READ_ORDERS' names), asked once per record:
# backends/native.py points it at this machine's calibration (``attnkit calibrate``), which sits above this module
read_order: Callable[[int], str] = _rule_order
_STEP = _Call.S.offset // 8  # the 8-byte slot where a decode step's block (S .. lse: 14 slots) starts
_tls = threading.local()  # per thread: prepared decode records by call signature (ctypes releases the GIL)


def _decode_call(q, k, v, lo, hi, scale: float, chunk: int, threads: int, order: str | None = None) -> _Call:
    """Check a decode signature and build its call record (all but the per-step block: S, K / V strides, pointers,
    outputs). ``order``: K and V's read order (a name of :data:`READ_ORDERS`; None: :data:`read_order`'s)."""
    _require()
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"decode: q, k, v must be 4-d (B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, Dv); got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, L, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    if k.shape[0] != B or v.shape[0] != B or v.shape[1] != Hkv or k.shape[3] != D or Hkv < 1 or H % Hkv:
        raise ValueError(f"decode: k must be (B, Hkv, S, D) and v (B, Hkv, S, Dv) with H a multiple of Hkv for q "
                         f"{tuple(q.shape)}; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not 1 <= L <= DECODE_MAX_L:
        raise ValueError(f"decode: q has L = {L} rows per head; expected 1 to {DECODE_MAX_L} (use forward beyond)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPE_CODE:
        raise TypeError(f"decode: q, k, v must share one dtype of float32, bfloat16, float16; got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}")
    if not (q.is_cpu and k.is_cpu and v.is_cpu and lo.is_cpu and hi.is_cpu):
        raise ValueError("decode: the compiled kernel reads CPU tensors only; got tensors on "
                         f"{q.device}, {k.device}, {v.device}")
    if q.stride(-1) != 1 and D > 1:
        raise ValueError(f"decode: q's last dim must be contiguous (stride 1); got strides {q.stride()}")
    if lo.dtype != torch.int32 or hi.dtype != torch.int32 or lo.shape != hi.shape or lo.dim() not in (2, 3) \
            or lo.shape[-2] not in (1, B) or lo.shape[-1] != L or (lo.dim() == 3 and not
                                                                   1 <= lo.shape[0] <= MAX_PLANES):
        raise ValueError(f"decode: lo, hi must be int32 of shape (1 or B, L) = (1 or {B}, {L}), or (n, 1 or B, L) "
                         f"for rows of n <= {MAX_PLANES} stretches; got {lo.dtype} {tuple(lo.shape)}, {hi.dtype} "
                         f"{tuple(hi.shape)}")
    if chunk < 0 or chunk % TILE:
        raise ValueError(f"decode: chunk must be 0 (chosen from S) or a positive multiple of {TILE}; got {chunk}")
    order = read_order(threads) if order is None else order
    if order not in READ_ORDERS:
        raise ValueError(f"decode: order must be one of {sorted(READ_ORDERS)} or None; got {order!r}")
    TB = lo.shape[-2]
    c = _Call(size=ctypes.sizeof(_Call), version=_ABI_VERSION, B=B, H=H, Hkv=Hkv, L=L, D=D, Dv=Dv,
              lob=(L if TB == B and B > 1 else 0), threads=threads, scale=float(scale),
              dtype=_DTYPE_CODE[q.dtype], chunk=chunk, nst=lo.shape[0] if lo.dim() == 3 else 1, lst=TB * L,
              order=READ_ORDERS[order])
    c.sq[:] = q.stride()[:3]
    return c


def _decode_record(key, q, k, v, lo, hi, scale: float, chunk: int):
    """:func:`_decode_call` for a new signature of :func:`decode`, kept per thread under ``key``; returns (its 8-byte
    slots, its pointer, out shape, lse shape, D > 1, Dv > 1, the record)."""
    c = _decode_call(q, k, v, lo, hi, scale, chunk, key[-1], key[-3])
    c.ort = int(key[-2])
    B, H, L, D = q.shape
    Dv = v.shape[3]
    slots = (ctypes.c_int64 * (ctypes.sizeof(_Call) // 8)).from_buffer(c)
    rec = (slots, ctypes.byref(c), (B, H, L, Dv), (B, H, L), D > 1, Dv > 1, c)
    cache = getattr(_tls, "decode", None)
    if cache is None or len(cache) > 64:  # a few signatures per model; never grows without bound
        cache = _tls.decode = {}
    cache[key] = rec
    return rec


def decode(q, k, v, lo, hi, scale: float, chunk: int = 0, need_lse: bool = True, alibi=None, prog=None,
           rounded: bool = False, order: str | None = None):
    """(out (B, H, L, Dv) fp32, lse (B, H, L) fp32, or None when not ``need_lse``) of attention for a few query
    rows over a key/value cache — with ``rounded`` and bf16 / fp16 inputs, out in their dtype, each row merged in
    fp32 and rounded once by the kernel as it writes it (the bits of ``out.to(q.dtype)``, without that pass) —
    on the compiled kernel's decode entry (csrc/attn_decode.h): the g = H / Hkv
    query heads of a kv head read its K and V once, and long caches are split over the threads (split-K, exact
    lse merge; the same bits at any thread count).

    q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv): CPU, one dtype of float32 / bfloat16 / float16 (read in
    place, widened in registers, never converted whole), last dim contiguous, any other strides (a view into a
    bigger preallocated cache is read in place); 1 <= L <= 64; H a multiple of Hkv. lo, hi: int32 contiguous
    (1 or B, L): query row i sees keys lo <= j < hi (bottom-right causal, windows, padding: the masks'
    ``row_intervals``); or (n, 1 or B, L), n <= ``MAX_PLANES``: row i sees the union of n stretches
    ``[lo[t, ., i], hi[t, ., i])`` (attention sinks and a window), one pass over the keys, an empty stretch (lo >= hi)
    adding nothing::

        lo = [[[0]], [[6]]], hi = [[[2]], [[10]]]   (S = 10):   █ █ · · · · █ █ █ █

    A row that sees no key: out 0, lse -inf. ``chunk``: keys per split-K chunk (a multiple of 64), 0 to let the
    kernel choose from S. ``alibi``: (H,) slopes added as ``slope[h] · (kv − q)``, or
    ``prog``: a traced score_mod (:class:`attnkit._scoreprog.Program`, query index ``0 … L-1``) run on the scaled
    scores before the mask, as in :func:`forward`. No autograd, no tile map (the forward has them). ``order``: K
    and V's read order, a name of :data:`READ_ORDERS` (the same bits in each); None: this machine's (:data:`read_order`,
    asked when a signature's record is first prepared).

    Per call only S, K / V strides, the pointers and the outputs are written (one block of the record), into a
    record prepared once per signature (q's shape and strides, dtypes, B / Hkv / D / Dv, lo / hi shapes, scale,
    chunk, order, threads) and kept per thread."""
    if alibi is not None or prog is not None:  # the record points at them: prepared for this call only
        if not need_lse:
            return decode_step(q, k, v, lo, hi, chunk, alibi, prog, rounded=rounded, order=order)(q, k, v, scale), None
        return decode_step(q, k, v, lo, hi, chunk, alibi, prog, with_lse=True, rounded=rounded,
                           order=order)(q, k, v, scale)
    ksh, vsh = k.shape, v.shape
    ort = rounded and q.dtype is not torch.float32
    key = (q.shape, q.stride(), q.dtype, k.dtype, v.dtype, ksh[0], ksh[1], ksh[3], vsh[0], vsh[1], vsh[3],
           lo.shape, hi.shape, scale, chunk, order, ort, torch.get_num_threads())
    try:
        f, ref, oshape, lshape, dk, dv, _ = _tls.decode[key]
    except (AttributeError, KeyError):
        f, ref, oshape, lshape, dk, dv, _ = _decode_record(key, q, k, v, lo, hi, scale, chunk)
    ks, vs = k.stride(), v.stride()
    S = ksh[2]
    if vsh[2] != S or (ks[3] != 1 and dk) or (vs[3] != 1 and dv) or not (lo.is_contiguous() and hi.is_contiguous()) \
            or not (q.is_cpu and k.is_cpu and v.is_cpu):
        raise ValueError(f"decode: q, k, v must be CPU tensors, k and v holding the same S keys with a contiguous "
                         f"last dim, lo / hi contiguous; got k {tuple(ksh)} strides {ks} on {k.device}, v "
                         f"{tuple(vsh)} strides {vs}")
    out = torch.empty(*oshape, dtype=q.dtype if ort else torch.float32, device=_CPU)
    lse = torch.empty(*lshape, dtype=torch.float32, device=_CPU) if need_lse else None
    f[_STEP:_STEP + 14] = (S, *ks[:3], *vs[:3], q.data_ptr(), k.data_ptr(), v.data_ptr(), lo.data_ptr(),
                           hi.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr())
    rc = _lib.ak_decode(ref)  # type: ignore[union-attr]  # loaded: the record above was built by _decode_record
    if rc:
        raise (MemoryError if rc == 1 else RuntimeError)(f"attnkit's compiled kernel: decode refused (code {rc})")
    return out, lse


def dense_tiles_fn():
    """``f(mask, L, S, kinds, index, bits) -> P``, or None (the kernel not loaded, or a build without it): the
    kernel's tile map of a CPU bool ``mask`` of shape (TB, TH, 1 or L, 1 or S) (any strides; fewer dims: the leading
    ones of size 1) over a call of L rows
    and S keys, read off its bytes in C (``ak_dense_tiles`` in csrc/attn_dispatch.cpp), written into ``kinds`` int8
    and ``index`` int32, both contiguous (TB, TH, nq, nk), and the first ``bits.shape[0]`` partial tiles' bits into
    ``bits`` int32 (cap, 2, 64) contiguous; returns P, the number of partial tiles (more than ``cap``: call again
    with room for P)."""
    _load()
    if _lib is None or not hasattr(_lib, "ak_dense_tiles"):
        return None
    f = _ext.dense_tiles if _ext is not None and hasattr(_ext, "dense_tiles") else _lib.ak_dense_tiles

    def dense_tiles(mask: torch.Tensor, L: int, S: int, kinds: torch.Tensor, index: torch.Tensor,
                    bits: torch.Tensor) -> int:
        shape: tuple[int, ...] = tuple(mask.shape)
        strides = mask.stride()
        if len(shape) < 4:  # (fewer dims: leading dims of 1, as the API broadcasts them; no reshape per call)
            shape, strides = (1,) * (4 - len(shape)) + shape, (0,) * (4 - len(shape)) + strides
        TB, TH, Lm, Sm = shape
        m0, m1, m2, m3 = strides
        return int(f(mask.data_ptr(), TB, TH, L, S, m0 if TB > 1 else 0, m1 if TH > 1 else 0, m2 if Lm > 1 else 0,
                     m3 if Sm > 1 else 0, kinds.data_ptr(), index.data_ptr(), bits.data_ptr(), bits.shape[0]))

    return dense_tiles


def tile_rows_fn():
    """``f(kinds, index, bits, L, S, lo, hi) -> bool``, or None (the kernel not loaded, or a build without it): a
    tile map's row intervals read in C (``ak_tile_rows``): ``kinds`` / ``index`` contiguous (TB, 1, nq, nk),
    ``bits`` contiguous (P, 2, 64), as :func:`dense_tiles_fn` writes them. Where every row sees one stretch of keys,
    writes them into ``lo`` / ``hi`` int32 contiguous (TB, L) (a row that sees nothing: 0, 0) and returns True;
    else False (``lo`` / ``hi`` then hold nothing meaningful)."""
    _load()
    if _lib is None or not hasattr(_lib, "ak_tile_rows"):
        return None
    f = _ext.tile_rows if _ext is not None and hasattr(_ext, "tile_rows") else _lib.ak_tile_rows

    def tile_rows(kinds: torch.Tensor, index: torch.Tensor, bits: torch.Tensor, L: int, S: int, lo: torch.Tensor,
                  hi: torch.Tensor) -> bool:
        return bool(f(kinds.data_ptr(), index.data_ptr(), bits.data_ptr(), kinds.shape[0], L, S, lo.data_ptr(),
                      hi.data_ptr()))

    return tile_rows


_suspect_rows = None


def suspect_rows_fn():
    """``f(out, whole=False) -> bool``: whether a CPU (B, H, L, Dv) fp32 / bf16 / fp16 tensor (any strides) has a
    row whose first element is zero or NaN, or (``whole``) a NaN anywhere, read in C (no tensor op; the first
    element alone: on a 2-core AMD EPYC 3.6 µs a call against 8-17 µs for ``not out.select(-1, 0).all()``:
    BENCHMARKS.md; through the extension's vectorcall 0.8 µs against ctypes' 2.3 for a (1, 8, 1, 64) output:
    ``benchmarks/call_costs.py``); None when the kernel is not loaded."""
    global _suspect_rows
    if _suspect_rows is not None:
        return _suspect_rows
    _load()
    f = _ext.suspect_rows if _ext is not None else getattr(_lib, "ak_suspect_rows", None)
    if f is None:
        return None
    codes = _DTYPE_CODE

    def suspect_rows(out: torch.Tensor, whole: bool = False) -> bool:
        n0, n1, n2, n3 = out.shape
        s0, s1, s2, s3 = out.stride()
        return bool(f(out.data_ptr(), codes[out.dtype], n0, n1, n2, n3, s0, s1, s2, s3, int(whole)))

    _suspect_rows = suspect_rows
    return suspect_rows


def release_scratch() -> None:
    """Give back the scratch memory the backward keeps between calls on this thread (δ, the per-block
    dQ turns and key-tile ranges of the largest call so far: about B·H·L floats). The next backward
    allocates it again."""
    if available():
        _require().ak_release_scratch()
