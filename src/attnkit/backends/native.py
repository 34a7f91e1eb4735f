"""attnkit's compiled CPU kernel as a declared kernel (``backend="tiled"``, worker ``native``): when it can
run a call, what it is handed, and its autograd.

The kernel itself (C++, ``src/attnkit/csrc``; the ctypes layer :mod:`._native`) is block-sparse
FlashAttention-2, forward and backward. A mask reaches it as one of (see :func:`_mask_of`)::

    row intervals   a built-in mask that is one stretch of keys per row: lo[i] <= j < hi[i]
    tile map        any other mask: 64 x 64 tile kinds, each partial tile with its own bits
                    (attnkit.backends._tilebits), evaluated once per content of the mask

and a score_mod as a traced program (:mod:`attnkit._scoreprog`) or, for ALiBi with fixed slopes, as
its slopes. Shapes: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv); out (B, H, L, Dv), lse (B, H, L).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import threading
import types
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from .. import _calibrate, _lru, _mods, _scoreprog, _tiling
from .. import masks as _masks
from .. import plans as _plans
from .. import score_mods as _score_mods
from . import _native, _softmax, _tilebits, _tiles, eager, tiled
from ._base import Request
from ._kernel import Kernel

__all__ = ["NATIVE", "NATIVE_DECODE", "Native", "NativeDecode", "native_unfit"]

_FULL = _masks.full()
# (mask.cache_key(), B, L, S) -> row intervals (or None). Built-in masks are immutable values, so the key
# fixes the result; a mask without a key (an opaque mask_mod reading mutable data) is never cached. A
# decode loop or a short prompt asks for the same intervals every step: ~20-60 µs each, once.
_IV_CACHE: OrderedDict = OrderedDict()
_IV_CACHE_MAX = 64


def _row_intervals(mask, B: int, L: int, S: int):
    key = mask.cache_key()
    if key is None:
        return mask.row_intervals(B, L, S)
    key = (key, B, L, S)
    iv = _lru.get(_IV_CACHE, key)
    if iv is _lru.MISSING:
        iv = mask.row_intervals(B, L, S)
        _lru.put(_IV_CACHE, key, iv, _IV_CACHE_MAX)
    return iv


_BF16_HW: bool | None = None


def _torch_alone_multiplies_bf16() -> bool:
    """Whether torch's kernels multiply bf16 in hardware here and the compiled kernel does not (it does on AMX:
    ``_native.bf16_dot()``; Intel Xeon with AMX, 2 threads, L = 4096, causal, forward: 36.8 ms against torch's
    48.9 and the kernel's fp32 78.3; `python benchmarks/bf16_auto.py`). Today's rules keep bf16 on torch's kernels
    only then (the forward without a calibration; with gradients, and SDPA's widening, unless measured)."""
    return _bf16_hardware() and not _native.bf16_dot()


def _bf16_hardware() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 / AMX) that torch's kernels use."""
    global _BF16_HW
    if _BF16_HW is None:
        try:
            _BF16_HW = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            _BF16_HW = False
    return _BF16_HW


def _alibi(req: Request):
    """ALiBi's (H,) slopes when the call's score_mod is ALiBi with fixed slopes (the compiled kernel adds the
    bias), else None (learned slopes run as a traced program, which returns their gradient)."""
    sm = req.score_mod
    if "score_prog" in req.memo:
        return None
    # attnkit's own ALiBi only: a subclass may compute something else in its __call__ (it runs as a program)
    if type(sm) is _score_mods.Alibi and not (sm.slopes.requires_grad and torch.is_grad_enabled()):
        return sm.slopes
    return None


def _score_program(req: Request) -> str | None:
    """Leave a score_mod's traced program in ``req.memo["score_prog"]`` (none for ALiBi with fixed slopes: the
    kernel adds its bias); the reason when the kernel's programs cannot run it, else None."""
    if req.score_mod is None or _alibi(req) is not None or "score_prog" in req.memo:
        return None
    B, H, L, S, *_ = req.shape
    try:
        prog = _scoreprog.compile_score_mod(req.score_mod, B, H, L, S)
    except _scoreprog.Refused as e:
        return f"a score_mod the kernel's programs do not cover: {e}"
    learned = {id(t) for t in prog.grad_of if t is not None}
    if any(id(t) not in learned for t in req.grad_tensors):
        return ("a score_mod tensor that requires grad but is not read as a table (e.g. a copy made inside "
                "the score_mod): the kernel could not return its gradient")
    req.memo["score_prog"] = prog
    return None


def _kernel_off(req: Request, dtype_why: str) -> list[str]:
    """What keeps both of the compiled kernel's entries off a call: the switch, the device, the dtype."""
    why: list[str] = []
    if not tiled.NATIVE:
        why.append("the compiled kernel is switched off (tiled.NATIVE = False)")
    if req.device_type != "cpu":
        why.append(f"tensors on {req.device_type} (the compiled kernel is CPU-only)")
    if req.q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        why.append(f"{req.q.dtype} ({dtype_why})")
    return why


class Native(Kernel):
    name = "native"
    backend = "tiled"
    worker = "native"
    title = "the compiled kernel"
    devices = ("cpu",)
    measured = ("benchmarks/auto_grid.py and benchmarks/kernel.py (2 threads, fp32): faster than torch's flash "
                "kernel per run on every structured mask; against SDPA itself, see sdpa.FUSED's rules")

    def not_supported(self, req: Request) -> list[str]:
        """Every reason the compiled kernel cannot run ``req``. When it can, what it needs is left in
        ``req.memo``: the mask's row intervals (``"row_intervals"``) or its tile map with each partial
        tile's bits (``"tile_bits"``), and a score_mod's program (``"score_prog"``)."""
        why = _kernel_off(req, "the compiled kernel computes in fp32; float64 stays in float64")
        if req.shape[2] == 0:
            why.append("no query rows (L = 0)")
        if req.q.dtype in (torch.bfloat16, torch.float16):
            # this machine's measurement (attnkit calibrate), else today's rule: bf16 stays on torch's kernel
            # where the CPU multiplies bf16 in hardware (measured on a CPU with AMX: `python benchmarks/kernel.py
            # --dtype bf16 --cases dense,causal`, torch's bf16 kernel 2.2-2.5x the compiled kernel's forward)
            x = _calibrate.crossovers()
            # ... and only for a call torch runs as one fused kernel (no mask or causal, no score_mod): a
            # structured mask or a score_mod makes it torch's flash kernel per run of tiles or plain torch ops per
            # tile, in bf16 slower than the compiled kernel's fp32 math (Intel Xeon with AMX, 2 threads, L = 4096,
            # sliding window 256: forward 22.4 against 18.9 ms, forward + backward 194 against 66 ms;
            # `python benchmarks/bf16_auto.py`, BENCHMARKS.md)
            whole = req.score_mod is None and req.plan is None and (req.mask is None or req.causal)
            case = None if req.dense_mask is not None or req.bias is not None else "causal" if req.causal else (
                "none" if req.mask is None else None)
            keep = x.torch_keeps(req.q.dtype, _torch_alone_multiplies_bf16, case) if whole else None
            # a bf16 call that wants gradients: the kernel where the table says its backward wins (bf16_grad),
            # whatever the forward's choice (the two are measured apart: `attnkit calibrate --backward`)
            to_kernel = req.requires_grad() and x.grad_to_kernel(req.q.dtype, _torch_alone_multiplies_bf16)
            if keep is not None and not to_kernel:
                why.append(keep)
        if req.dropout_p > 0:
            why.append("dropout (the compiled kernel has none)")
        if req.bias is not None:
            why.append("a float mask (the compiled kernel takes a mask as row intervals or a tile map)")
        if req.dense_mask is not None and (req.mask is not None or req.plan is not None):
            why.append("a bool tensor mask with another mask on top (the compiled kernel reads one bool mask's tiles)")
        if req.plan is not None and (req.plan.block[0] % _tilebits.TILE or req.plan.block[1] % _tilebits.TILE):
            why.append(f"an explicit plan of {req.plan.block[0]} x {req.plan.block[1]} tiles "
                       "(the kernel's are 64 x 64)")
        if req.grad_hidden and torch.is_grad_enabled():
            why.append("gradients into tensors the score_mod reads where attnkit cannot find them")
        if why:
            return why
        B, H, L, S, *_ = req.shape
        refused = _score_program(req)
        if refused:
            return [refused]
        if req.dense_mask is not None and "tile_bits" not in req.memo and "row_intervals" not in req.memo:
            # a user's bool tensor: its tiles read off its values (the route's tile summary of it reused)
            _keep_map_or_intervals(req, _tilebits.dense_bits(req.dense_mask, L, S, req.memo), L, S)
        if req.plan is not None and "tile_bits" not in req.memo and "row_intervals" not in req.memo:
            try:  # its tiles as given (a BlockMask's), the mask evaluated in the partial ones
                tb = _tilebits.plan_bits(req.plan, req.plan_extra, B, H, L, S)
            except Exception as e:
                return [f"the plan's mask could not be evaluated on stacked 64 x 64 tiles for the kernel's tile map "
                        f"({type(e).__name__}: {e})"]
            _keep_map_or_intervals(req, tb, L, S)
        if "row_intervals" not in req.memo and "tile_bits" not in req.memo:
            mask = req.mask if req.mask is not None else _FULL
            iv = _row_intervals(mask, B, L, S)
            if iv is not None:
                req.memo["row_intervals"] = iv
            else:
                try:
                    tb = _tilebits.tile_bits(mask, B, H, L, S)
                except Exception as e:  # a mod that cannot run on stacked tiles: torch's kernels evaluate it per run
                    return [f"mask {req.mask!r} could not be evaluated on stacked 64 x 64 tiles for the kernel's "
                            f"tile map ({type(e).__name__}: {e})"]
                _keep_map_or_intervals(req, tb, L, S)
        if not _native.available():
            _native.warn_missing()
            return [_native.unavailable_reason()]
        return []

    def auto_reason(self, req: Request, passed) -> str:
        return tiled.auto_reason(req, passed)

    def why(self, req: Request) -> str:
        tb = req.memo.get("tile_bits")
        if tb is None and req.memo.get("intervals_of_map"):
            how = ("the mask's row intervals (read off its tile map: every row sees one stretch of keys), empty "
                   "tiles skipped, full tiles unmasked")
        elif tb is None:
            how = "the mask's row intervals, empty tiles skipped, full tiles unmasked"
        else:
            how = (f"the mask's tile map ({100 * tb.computed_fraction:.0f}% of 64 x 64 tiles computed, "
                   f"{tb.partial_tiles} partial tiles masked by their own bits)")
        prog = req.memo.get("score_prog")
        if prog is not None:
            how += f", the score_mod run as a {len(prog.ops)}-instruction program"
        return f"attnkit's compiled kernel ({_native.isa()}): block-sparse FlashAttention-2 over {how}"

    def replay(self, req: Request, user_mask):
        """The prepared call for :mod:`attnkit._fast` (see ``sdpa.Fused.replay``): a built-in mask's row intervals
        or tile map (values of this signature) kept, the request rebuilt around each call's tensors; None for what
        the signature does not fix (a score_mod, a tensor mask, a plan) or for more than an output."""
        if req.need_lse or req.weight_heads is not None or req.sinks is not None or req.grad_tensors:
            return None
        if type(user_mask) is torch.Tensor:
            return self._replay_dense(req, user_mask)
        if "row_intervals" not in req.memo and "tile_bits" not in req.memo:
            return None
        default = req.scale
        alibi = _alibi(req)
        if not req.requires_grad():  # the signature fixes it: no autograd, one record
            lo, hi, tiles = _mask_of(req)
            step = _native.forward_step(req.q, req.k, req.v, lo, hi, tiles, rounded=True, **_kept_scores(req))

            def run_step(q, k, v, mask, scale):  # (out in q's dtype: rounded by the kernel)
                return step(q, k, v, default if scale is None else scale)

            return run_step
        if req.mask is not None and type(req.mask) not in _CLOSED_FORM and _mods.holds_data(req.mask.cache_key()):
            return None  # with gradients the first call's request is kept, and its backward's exact-rows fix reads
            # the mask object: one reading a tensor (edited since, its content now another key's) is not kept
        if req.score_mod is not None:  # with gradients: replayed only for a program reading no tensor (a soft cap):
            prog = req.memo.get("score_prog")  # its code and numbers are the signature's; a table or ALiBi's slopes
            if prog is None or prog.tables:  # are the first call's objects (the backward's exact-rows fix reads them)
                return None
        base = _bare(req)  # the first call's request without its tensors: its mask, flags and memo
        pair = _step_pair(req, base, alibi)
        if pair is not None:
            def run_pair(q, k, v, mask, scale):
                return _NativeStep.apply(q, k, v, pair, default if scale is None else scale)

            return run_pair

        def run(q, k, v, mask, scale):
            r = dataclasses.replace(base, q=q, k=k, v=v, scale=default if scale is None else scale)
            return _NativeAttention.apply(q, k, v, r)[0]

        return run

    def _replay_dense(self, req: Request, user_mask: torch.Tensor):
        """The prepared forward and backward (:class:`_NativeStep`) for a bool tensor mask of a bf16 / fp16 call that
        wants gradients — a decision the mask's values do not enter (``auto`` sends such a call to the kernel
        whatever its mask holds: ``sdpa._bf16_grads_fit_kernel``, where the table says the kernel's backward wins
        for bf16; where it does not, SDPA's choice reads the mask's tiles, and the call takes the full path). The mask
        is the call's own: each call reads its tile map in C and takes a digest of the map (:func:`_map_key`: the map
        is the mask's content, a few KB where the mask is MB; without the C pass, a digest of the mask's bytes,
        ``_mods._content``) and runs the pair prepared for that content (its map kept with a frozen copy of the
        mask), the last ``_DENSE_PAIRS`` contents kept; a mask edited in place is a new content. A call without
        gradients: :func:`_replay_dense_forward` (a score_mod too). None (the full path) for anything else: fp32
        with gradients (its route reads the mask's tiles), a score_mod with gradients, more than
        ``CONTENT_KEY_MAX_BYTES`` of mask (the frozen copies the signature keeps)."""
        if user_mask.dtype is torch.bool and req.dense_mask is not None and not req.requires_grad():
            return _replay_dense_forward(req)
        if (user_mask.dtype is not torch.bool or req.dense_mask is None or req.score_mod is not None
                or not req.requires_grad() or req.q.dtype is torch.float32 or req.memo.get("score_prog") is not None):
            return None
        # bf16 where this machine's table keeps torch's bf16 backward in the race: SDPA's choice then reads the
        # mask's tiles (DENSE_PARTIAL_MAX), a decision of each content — the full path
        if req.q.dtype is torch.bfloat16 and _calibrate.crossovers().grad_to_kernel(
                torch.bfloat16, _torch_alone_multiplies_bf16) is None:
            return None
        shape4 = req.dense_mask.shape
        L, S = req.shape[2], req.shape[3]
        # a big mask keyed by its tile map (reading it in C and hashing the map costs less than hashing the mask from
        # ~64 KB on; below, the map's fixed cost of a few tensors is the more: a 4 KB tile's digest, a few µs)
        by_map = _native.dense_tiles_fn() is not None and user_mask.numel() >= _MAP_KEY_MIN_BYTES
        if user_mask.numel() > _mods.CONTENT_KEY_MAX_BYTES:  # (the frozen copies a signature keeps: bounded)
            return None
        first = _map_key(user_mask.reshape(shape4), L, S)[0] if by_map else _mods._content(user_mask)
        if first is None:
            return None
        default = req.scale
        pairs: OrderedDict = OrderedDict()

        def prepare(r: Request) -> _StepPair | None:
            return _step_pair(r, _bare(r), None)

        frozen = dataclasses.replace(req, dense_mask=req.dense_mask.clone())  # (its memo: this content's tile map)
        pairs[first] = prepare(frozen)
        template = dataclasses.replace(_bare(req), dense_mask=None, memo={})  # (for a new content's request)

        def run(q, k, v, mask, scale):
            # (the signature fixes its shape, dtype and device: the 4-d view the full path takes of it, only where it
            # is read: a reshape costs a small call several µs)
            key, memo = _map_key(mask.reshape(shape4), L, S) if by_map else (_mods._content(mask), {})
            if key is None:
                return None
            pair = _lru.get(pairs, key)
            if pair is _lru.MISSING:
                r = dataclasses.replace(template, q=q, k=k, v=v, dense_mask=mask.reshape(shape4).clone(), memo=memo)
                pair = None if self.not_supported(r) else prepare(r)
                _lru.put(pairs, key, pair, _DENSE_PAIRS)
            if pair is None:
                return None
            return _NativeStep.apply(q, k, v, pair, default if scale is None else scale)

        return run

    def run(self, req: Request):
        if "row_intervals" not in req.memo and "tile_bits" not in req.memo:
            why = self.not_supported(req)
            if why:
                raise RuntimeError(f"the compiled kernel cannot run this call: {'; '.join(why)}")
        captured = list(req.grad_tensors) if torch.is_grad_enabled() else []
        return _NativeAttention.apply(req.q, req.k, req.v, req, *captured)


def _replay_dense_forward(req: Request):
    """The prepared forward of a bool tensor mask's call without gradients (:meth:`Native.replay`): every call reads
    *its own* mask's tiles in C (``_native.dense_tiles_fn``: one pass over its bytes, ~3 µs a call for a 64 x 64
    tile, 0.7 ms at 2048 x 2048 on an Intel Xeon, ``benchmarks/mask_read.py``) into buffers the prepared records
    point at (one set per thread), and, for a mask shared by the heads, its rows (``_native.tile_rows_fn``): where
    every row sees one stretch of keys the kernel runs on those intervals, else on the tile map — as the full path
    decides for that mask (:func:`_keep_map_or_intervals`), each way prepared once. The route reads the mask's
    values only above one tile (``tiled.DENSE_PARTIAL_MAX``: almost every tile partial stays with SDPA): there each
    call's share of partial tiles is checked, and a call past it takes the full path. None where the C passes are
    not built or the map has more than ``_REPLAY_TILES_MAX`` tiles."""
    read, rows_of = _native.dense_tiles_fn(), _native.tile_rows_fn()
    dense = req.dense_mask
    if read is None or rows_of is None or dense is None or req.need_lse or tiled._sizes()[:2] != (64, 64):
        return None  # (other tile sizes: the route counts partial tiles of its own size)
    B, H, L, S, *_ = req.shape
    if L <= DECODE_ROWS:  # a few rows (with a score_mod: SDPA cannot take it): the full path, whose choice between
        return None  # the decode entry and this forward reads each call's mask
    shape4 = tuple(dense.shape)
    TB, TH = shape4[0], shape4[1]
    nq, nk = -(-L // _tilebits.TILE), -(-S // _tilebits.TILE)
    n = TB * TH * nq * nk
    if n > _REPLAY_TILES_MAX:
        return None
    checked = not (L <= tiled.SMALL_MASK and S <= tiled.SMALL_MASK)  # (one tile: a decision the values do not enter)
    limit = tiled.DENSE_PARTIAL_MAX * nq * nk
    default, scores = req.scale, _kept_scores(req)
    local = threading.local()

    def prepared(q, k, v):  # this thread's tile buffers, row intervals and the records that point at them (built for
        # the tensors of its first call: the records keep no tensor of a call)
        # (bits: room for every tile, its pages touched only as far as a call's partial tiles reach: a map of few
        # partial tiles costs little memory whatever its size; each call writes the bits it has the kernel read)
        tb = _tilebits.TileBits(torch.zeros(TB, TH, nq, nk, dtype=torch.int8),
                                torch.full((TB, TH, nq, nk), -1, dtype=torch.int32),
                                torch.empty(n, 2, _tilebits.TILE, dtype=torch.int32))
        lo, hi = torch.zeros(TB, L, dtype=torch.int32), torch.full((TB, L), S, dtype=torch.int32)
        every = torch.zeros(1, L, dtype=torch.int32), torch.full((1, L), S, dtype=torch.int32)
        on_tiles = _native.forward_step(q, k, v, *every, tb, rounded=True, **scores)
        on_rows = _native.forward_step(q, k, v, lo, hi, None, rounded=True, **scores) if TH == 1 else None
        local.got = got = (tb, lo, hi, on_tiles, on_rows)
        return got

    def run(q, k, v, mask, scale):
        got = getattr(local, "got", None)
        tb, lo, hi, on_tiles, on_rows = prepared(q, k, v) if got is None else got
        P = read(mask, L, S, tb.kinds, tb.index, tb.bits)  # (the user's tensor as it is: its rank <= 4)
        if checked and (P if TB * TH == 1 else _partial_collapsed(tb.kinds)) > limit:
            return None  # almost every tile partial: the full path's route (SDPA)
        sc = default if scale is None else scale
        if on_rows is not None and rows_of(tb.kinds, tb.index, tb.bits, L, S, lo, hi):
            return on_rows(q, k, v, sc, lo, hi)  # every row one stretch of keys: on its interval
        return on_tiles(q, k, v, sc)

    return run


def _kept_scores(req: Request) -> dict:
    """What a prepared forward without gradients keeps of the call's score_mod, as ``forward_step``'s keywords: its
    program (its tables are its own copies) and ALiBi's fixed slopes (the kernel adds them as its own bias, with no
    program), copied: the record outlives the call, and the signature keys the slopes by their content at this
    call. Every replay of the kernel's forward takes both from here (one once left ALiBi out: no bias)."""
    alibi = _alibi(req)
    return {"alibi": None if alibi is None else alibi.detach().clone(), "prog": req.memo.get("score_prog")}


def _map_key(mask4: torch.Tensor, L: int, S: int):
    """``(key, memo)``: a bool mask's content as its tile map read in C (:func:`_tilebits.dense_bits`; the map is the
    mask: unpacked, the same values), keyed by a digest of the map's bytes — kinds, partial tiles' order and bits, a
    few KB where the mask is MB (4 causal documents at L = 2048: 4 MB of mask, under 1 ms to read against ~10 ms to
    hash it, Intel Xeon) — and the request memo holding that map (a new content's request reuses it)."""
    memo: dict = {}
    tb = _tilebits.dense_bits(mask4, L, S, memo)
    h = hashlib.blake2b(digest_size=16)
    for t in (tb.kinds, tb.index, tb.bits):
        h.update(t.numpy().tobytes())
    return ("tile map", tuple(tb.kinds.shape), tb.partial_tiles, h.digest()), memo


def _partial_collapsed(kinds: torch.Tensor) -> int:
    """The tiles that are partial for some (batch, head) or differ between them (as the route counts them)."""
    return int((_tiling.collapse(kinds) == _tiling.PARTIAL).sum())


NATIVE = Native()
_NOTHING = torch.empty(0)
# a bool tensor mask's signature without gradients is replayed with room for every tile's bits up to this many
# tiles (512 B a tile: 8 MB; L = S = 8192 at one mask for every batch row and head)
_REPLAY_TILES_MAX = 16384
_DENSE_PAIRS = 4  # the mask contents a bool tensor mask's replayed signature keeps prepared (Native._replay_dense)
# from this many bytes of bool mask a bf16 call with gradients keys its prepared pair by the mask's tile map (read in
# C) rather than by a digest of the mask's bytes (Native._replay_dense; Intel Xeon with AMX, forward + backward,
# `benchmarks/compare_revisions.py --only "bf16 fwd+bwd"`: 4 causal documents at L = 2048 1.34x faster; a 64 x 64
# tile 0.93x and a (1, 512) padding row 0.84x by the map, so those keep the digest)
_MAP_KEY_MIN_BYTES = 1 << 16


def _keep_map_or_intervals(req: Request, tb, L: int, S: int) -> None:
    """Leave in ``req.memo`` the tile map ``tb``, or, where every row of it sees one stretch of keys (a window,
    causal documents, a prefix-LM written as a ``mask_mod`` or a BlockMask), its row intervals: the kernel then
    trims partial tiles to each row's keys as it does for a built-in mask."""
    iv = _tilebits.row_intervals(tb, L, S)
    if iv is None:
        req.memo["tile_bits"] = tb
    else:
        req.memo["row_intervals"] = iv
        req.memo["intervals_of_map"] = True

_CLOSED_FORM = _masks.BUILT_IN  # their decode tiles and row intervals in closed form

# A decode step's mask evaluated at every point, up to this many (b, h, query, key) points at once (a bool each);
# a bigger call reads the rows off the mask's tile map instead
_DENSE_POINTS = 1 << 23


def _dense_row_intervals(mask, B: int, H: int, L: int, S: int, fn=None, spans: bool = False):
    """``(lo, hi)`` int32 ``(TB, L)`` as :func:`_tilebits.row_intervals` gives, for a call of a few query rows (a
    decode step), from the mask evaluated at each of its points in one call — no tile kinds, no range analysis, no
    cache: what a user's ``mask_mod`` that is new at every step of a decode loop (``kv <= q + offset``, its offset
    captured per step) costs per step. None: a row is not one stretch of keys, heads differ, or the call is too
    big to evaluate whole (``_DENSE_POINTS``; the caller then reads the tile map). Raises what the mod raises, and
    TypeError for a result that is not bool. ``fn``: the mod to evaluate on the index tensors (default
    ``mask.bind(L, S)``); ``spans``: as :func:`_bool_row_intervals`::

        L = 2, S = 6   allowed          lo  hi
                   q0  # # # . . .       0   3
                   q1  . # # # # .       1   5      q2 = # . # . . .  -> None (two stretches)
    """
    a = _dense_points(mask, B, H, L, S, fn)
    return None if a is None else _bool_row_intervals(a, L, S, spans)


def _dense_points(mask, B: int, H: int, L: int, S: int, fn=None) -> torch.Tensor | None:
    """The mask evaluated at every point of a call of a few query rows: a CPU bool tensor broadcastable to
    ``(B, H, L, S)``; None where the call is too big to evaluate whole (``_DENSE_POINTS``). Raises as
    :func:`_dense_row_intervals`."""
    if B * H * L * S > _DENSE_POINTS or S == 0:
        return None
    if fn is None:
        fn = mask.bind(L, S)
    a = fn(_index(B, 0), _index(H, 1), _index(L, 2), _index(S, 3))
    if not _indices_intact(max(B, H, L, S)):
        raise ValueError(f"mask {mask!r} wrote its index tensors in place")
    if type(a) is not torch.Tensor or a.dtype is not torch.bool:
        _masks._check_bool(a, fn)
    sh = a.shape
    if not (len(sh) == 4 and sh[3] in (1, S) and sh[2] in (1, L) and sh[1] in (1, H) and sh[0] in (1, B)) and (
            len(sh) > 4 or any(n not in (1, w) for n, w in zip(sh[::-1], (S, L, H, B), strict=False))):
        raise ValueError(f"mask {mask!r} gave shape {tuple(a.shape)} on the grid (B, H, L, S) = {(B, H, L, S)}")
    return a


# A decode step's row of a few stretches of keys (attention sinks and a window: two) runs on the decode entry as
# one call, the row seeing the union of its stretches (one pass over the keys; lo / hi planes (MAX_STRETCHES, TB,
# L), empty ones lo = hi = 0: one record shape whatever the count); more stretches go to the forward's tile map.
# At every cache length: the step costs what a one-stretch step costs (a window alone), below SDPA's kernel with
# the whole mask at every S measured (benchmarks/decode_sinks.py, BENCHMARKS.md)
MAX_STRETCHES = 4


def _bool_row_stretches(a: torch.Tensor, L: int, S: int, most: int = MAX_STRETCHES):
    """The stretches of keys of each row of a CPU bool tensor ``a`` broadcastable to ``(B, H, L, S)`` as the decode
    entry's planes ``(lo, hi)``, each int32 ``(most, TB, L)``: stretch k of a row in plane k, the planes past its
    stretches empty (``lo = hi = 0``); None where a row has more than ``most`` stretches or heads differ::

        sinks + window, S = 10:  █ █ · · · · █ █ █ █   ->  lo = [0, 6, 0, 0], hi = [2, 10, 0, 0]
    """
    x = _tiling.host_array(a)  # (the user's mask: .numpy() would leave it unable to resize_)
    if x.ndim and x.size == S and x.shape[-1] == S:  # one row for every batch row, head and query (a decode step)
        row = x.reshape(-1).tobytes()
        if row.count(0) + row.count(1) == S:  # (else a uint8 buffer viewed as bool: read below)
            spans = _row_spans(row, most)
            return None if spans is None else _span_planes(spans, L, most)
    rows = _key_rows(x, S)
    if rows is None:
        return None
    x = rows
    TB, Lx = x.shape[0], x.shape[1]
    # +1 where a stretch starts, -1 past its end (each byte read as 0 or 1: a uint8 buffer viewed as bool holds others)
    edges = np.diff((x.view(np.uint8) != 0).astype(np.int8), prepend=np.int8(0), append=np.int8(0), axis=-1)
    found = [[(np.flatnonzero(edges[b, i] == 1), np.flatnonzero(edges[b, i] == -1)) for i in range(Lx)]
             for b in range(TB)]
    k = max((len(st) for row in found for st, _ in row), default=0)
    if k > most:
        return None
    iv = np.zeros((2, most, TB, Lx), np.int32)
    for b in range(TB):
        for i in range(Lx):
            st, en = found[b][i]
            iv[0, :len(st), b, i], iv[1, :len(st), b, i] = st, en
    if Lx != L:
        iv = np.repeat(iv, L, axis=3)
    pl = torch.from_numpy(np.ascontiguousarray(iv))
    return pl[0], pl[1]


def _span_planes(spans: list[tuple[int, int]], L: int, most: int = MAX_STRETCHES):
    """One row's stretches ``spans`` (:func:`_row_spans`, at most ``most``) as the decode entry's planes: ``(lo,
    hi)``, each int32 ``(most, 1, L)`` (the planes past its stretches empty)."""
    iv = np.zeros((2, most, 1, L), np.int32)
    for t, (lo, hi) in enumerate(spans):
        iv[0, t], iv[1, t] = lo, hi
    pl = torch.from_numpy(iv)
    return pl[0], pl[1]


def _key_rows(x: np.ndarray, S: int) -> np.ndarray | None:
    """The key rows ``(TB, 1 or L, S)`` of a bool array broadcastable to ``(B, H, L, S)``, the first head's; None
    where heads differ (the decode entry's row intervals hold for every head of a kv group alike)."""
    if x.ndim < 4:
        x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if x.shape[1] > 1 and not (x == x[:, :1]).all():
        return None
    return np.broadcast_to(x[:, 0], (x.shape[0], x.shape[2], S))


def _bool_row_intervals(a: torch.Tensor, L: int, S: int, spans: bool = False, few: bool = False):
    """``(lo, hi)`` int32 ``(TB, L)`` of a CPU bool tensor ``a`` broadcastable to ``(B, H, L, S)`` (True =
    attend; any strides): a mod's points (:func:`_dense_row_intervals`) or a call's own bool mask, each row's one
    stretch of keys; None where a row is two stretches or heads differ. A row without a key: ``lo = hi = 0``.
    ``spans``: where ``a`` is one row of keys shared by every batch row, head and query (a decode step's), the
    two ints ``(lo, hi)`` instead (the decode step writes them into its own record: no tensors built). ``few``: rows
    of up to ``MAX_STRETCHES`` stretches give their planes (:class:`_Planes`; a shared row's read off the same bytes)
    instead of None."""
    x = _tiling.host_array(a)  # (the user's mask: .numpy() would leave it unable to resize_)
    if x.ndim and x.size == S and x.shape[-1] == S:  # one row for every batch row, head and query (a decode step)
        row = x.tobytes()
        span = _row_span(row)
        if span is None and few:
            if row.count(0) + row.count(1) == S:
                st = _row_spans(row, MAX_STRETCHES)
                return None if st is None else _Planes(_span_planes(st, L))
            return _few_planes(a, L, S)  # (a uint8 buffer viewed as bool: its bytes read as True where nonzero)
        if span is None or spans:
            return span
        return _one_row(span, L)
    rows = _key_rows(x, S)
    if rows is None:
        return None
    x = rows
    TB, Lx = x.shape[0], x.shape[1]
    if TB * Lx <= 4:  # a decode step's one or few rows: a scan each (~2 µs, the vector form's ~10)
        lo = np.zeros((TB, Lx), np.int32)
        hi = np.zeros((TB, Lx), np.int32)
        for b in range(TB):
            for i in range(Lx):
                nz = np.flatnonzero(x[b, i])
                n = nz.shape[0]
                if n:
                    first = nz[0]
                    if nz[-1] + 1 - first != n:
                        return _few_planes(a, L, S) if few else None
                    lo[b, i], hi[b, i] = first, first + n
    else:  # many rows (a batch whose rows differ): the count, first and last key of every row at once
        cnt = np.count_nonzero(x, axis=-1)
        first = x.argmax(-1)
        end = S - x[..., ::-1].argmax(-1)
        dead = cnt == 0
        if not ((end - first == cnt) | dead).all():
            return _few_planes(a, L, S) if few else None
        lo = np.where(dead, 0, first).astype(np.int32)
        hi = np.where(dead, 0, end).astype(np.int32)
    if Lx != L:
        lo, hi = np.repeat(lo, L, axis=1), np.repeat(hi, L, axis=1)
    return torch.from_numpy(lo), torch.from_numpy(hi)


def _row_span(row: bytes):
    """``(lo, hi)``: the one stretch of keys a bool row allows (its bytes, one per key: any nonzero byte is True,
    as to torch and NumPy, a uint8 buffer viewed as bool included), ``(0, 0)`` where it allows none; None where it
    is two stretches or more. Off the bytes in C loops (strip the zeros at either end, then one search for a zero
    between): under 1 µs at S = 1200, where NumPy's calls cost several µs each."""
    n = len(row)
    lo = n - len(row.lstrip(b"\0"))
    if lo == n:
        return 0, 0  # no key: a dead row (out 0)
    hi = len(row.rstrip(b"\0"))
    return None if row.find(0, lo, hi) >= 0 else (lo, hi)


def _row_spans(row: bytes, most: int) -> list[tuple[int, int]] | None:
    """The stretches ``[(lo, hi), ...]`` of keys a row allows (its bytes, each 0 or 1), in order; None where there
    are more than ``most``. Off the bytes in C loops (a search for the next 1, then the next 0)."""
    spans: list[tuple[int, int]] = []
    n, at = len(row), 0
    while True:
        lo = row.find(1, at)
        if lo < 0:
            return spans
        if len(spans) == most:
            return None
        hi = row.find(0, lo)
        hi = n if hi < 0 else hi
        spans.append((lo, hi))
        at = hi


def _one_row(span: tuple[int, int], L: int):
    """``span`` (:func:`_row_span`) as :func:`_dense_row_intervals` gives it: int32 ``(1, L)`` tensors."""
    iv = np.empty((2, 1, L), np.int32)
    iv[0], iv[1] = span
    t = torch.from_numpy(iv)
    return t[0], t[1]


def _plan_mask(plan, extra):
    """The mask a plan's tiles stand for, as points (a BlockMask's: its full blocks, its mod inside the partial
    ones; an ``attnkit.plan``'s: its mask), with ``extra`` (``causal=True``) on top."""
    return plan.mask if extra is None else _masks.And(extra, plan.mask)


class _Indices:
    """One thread's index tensors a mod is evaluated on: ``base = arange(size)``, its views along each dim of a 4-d
    grid, the small views a decode step reuses, and a pristine copy of it no mod sees (their addresses, for the
    content check after each evaluation). A thread's own: a mod in one thread never shifts another's."""

    __slots__ = ("addr", "arr", "base", "pristine", "pristine_addr", "size", "small", "views")

    def __init__(self, size: int):
        with torch.inference_mode(False):  # a normal tensor, whatever mode the first call runs in
            self.base = torch.arange(size)
            self.views = [self.base.view(-1, 1, 1, 1), self.base.view(1, -1, 1, 1), self.base.view(1, 1, -1, 1),
                          self.base.view(1, 1, 1, -1)]
        self.size = size
        self.small: dict[tuple[int, int], torch.Tensor] = {}
        self.arr, self.pristine = self.base.numpy(), np.arange(size, dtype=np.int64)
        assert self.arr.dtype == np.int64 and self.arr.flags.c_contiguous
        self.addr, self.pristine_addr = self.arr.ctypes.data, self.pristine.ctypes.data


_LOCAL = threading.local()


def _libc_memcmp():
    """The C library's ``memcmp`` (~1 µs for a decode step's few KB; NumPy's compare ~6), or None."""
    try:
        f = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    f.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    f.restype = ctypes.c_int
    return f


_MEMCMP = _libc_memcmp()


def _same_bytes(a: int, b: int, n: int) -> bool:
    """Whether the ``n`` bytes at addresses ``a`` and ``b`` are equal."""
    if _MEMCMP is not None:
        return _MEMCMP(a, b, n) == 0
    x = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(a))
    return bool(np.array_equal(x, np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(b))))


def _index(n: int, dim: int) -> torch.Tensor:
    """``arange(n)`` as an index tensor along ``dim`` of a 4-d grid: a view of this thread's arange (checked against
    its pristine copy after each evaluation: :func:`_indices_intact`)."""
    st = _LOCAL.__dict__.get("st")
    if st is None or n > st.size:
        st = _LOCAL.st = _Indices(max(n, 1 << 16))
    if n > 64:  # a key index, new every decode step (as_strided: ~2 µs, narrow's ~4)
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return st.base.as_strided(shape, (1, 1, 1, 1))
    t = st.small.get((n, dim))  # the batch, head and query indices of a decode step: the same few views every step
    if t is None:
        t = st.small[n, dim] = st.views[dim].narrow(dim, 0, n)
    return t


def _indices_intact(n: int) -> bool:
    """Whether the first ``n`` of this thread's index arange are still ``0 .. n - 1`` (its content, compared with a
    copy no mod sees: an in-place write is caught however it was made — ``q += 1``, ``kv.data``, a NumPy view); if
    not, the arange is dropped (the next call builds another): no later call's points are shifted."""
    st = _LOCAL.__dict__.get("st")
    if st is not None and n <= st.size and _same_bytes(st.addr, st.pristine_addr, n * 8):
        return True
    _LOCAL.__dict__.pop("st", None)
    return False


# The decode entry's query rows: one block of the kernel's (csrc/attn_decode.h takes up to 64 rows).
DECODE_ROWS = 16


# NativeDecode's one refusal that reads a bool tensor mask's values (the rest read its shape, as the call signature)
ROWS_REFUSAL = "a bool mask whose rows are not one stretch of keys each (nor a few), the same for every head"


def _first_rows(req: Request):
    """The row intervals ``(TB, L)`` a replay's one-stretch record takes its shapes from: the mask's, or its first
    stretch plane's (rows of a few stretches)."""
    st = req.memo.get("row_stretches")
    return (st[0][0], st[1][0]) if st is not None else req.memo["row_intervals"]


def _rows_known(req: Request) -> bool:
    return "row_intervals" in req.memo or "row_stretches" in req.memo


def _keep_rows(req: Request, iv) -> bool:
    """Keep the call's rows for :meth:`NativeDecode.run` — one interval each (``req.memo["row_intervals"]``) or the
    planes of a few stretches (:class:`_Planes`: ``req.memo["row_stretches"]``); False where there are none."""
    if iv is None:
        return False
    if isinstance(iv, _Planes):
        req.memo["row_stretches"] = iv.planes
    else:
        req.memo["row_intervals"] = iv
    return True


class NativeDecode(Kernel):
    """The compiled kernel's decode entry (:func:`attnkit.backends._native.decode`): a few query rows over a
    key/value cache, the g query heads of a kv head packed as rows that read its K and V once, long caches
    split over the threads (split-K, exact lse merge), strided / bf16 / fp16 caches read in place. Inference
    only (no autograd); a mask as row intervals (a built-in's, or read off a ``mask_mod``'s tile map), a
    score_mod as its traced program or ALiBi's slopes (as the forward)."""

    name = "native-decode"
    backend = "tiled"
    worker = "native"
    title = "the compiled kernel's decode entry"
    devices = ("cpu",)
    specialist = True
    measured = ("benchmarks/decode_splitk.py and benchmarks/overhead.py (2 threads): a decode step over a long "
                "cache at read bandwidth, and the smallest calls with the least Python around the kernel")

    def not_supported(self, req: Request) -> list[str]:
        B, H, L, S, *_ = req.shape
        why = _kernel_off(req, "the decode entry reads fp32, bf16 or fp16")
        if L > DECODE_ROWS:
            why.append(f"L = {L} > {DECODE_ROWS} query rows (not a decode step: the forward's tiles)")
        if L == 0:
            why.append("no query rows (L = 0)")
        if req.requires_grad():
            why.append("a gradient is wanted (the decode entry is inference only)")
        if req.bias is not None:
            why.append("a float bias (the decode entry takes a mask as row intervals)")
        if req.dense_mask is not None and (req.mask is not None or req.plan is not None):
            why.append("a bool tensor mask with another mask on top (the decode entry reads one bool mask's rows)")
        if req.plan is not None and (req.plan.block[0] % _tilebits.TILE or req.plan.block[1] % _tilebits.TILE):
            why.append(f"an explicit plan of {req.plan.block[0]} x {req.plan.block[1]} tiles "
                       "(the kernel's are 64 x 64)")
        if req.dropout_p > 0:
            why.append("dropout (the compiled kernel has none)")
        if why:
            return why
        refused = _score_program(req)  # a score_mod: its program (or ALiBi's slopes), as the forward
        if refused:
            return [refused]
        if req.plan is not None and "row_intervals" not in req.memo:  # a BlockMask's tiles, its mod in the partial
            try:  # ones (FlexAttention's meaning): each row's stretches of keys, read off its points or its tile map
                if B * H * L * S <= _DENSE_POINTS:
                    a = _dense_points(_plan_mask(req.plan, req.plan_extra), B, H, L, S)
                    iv = None if a is None else _bool_row_intervals(a, L, S, few=True)
                else:
                    iv = _tilebits.row_intervals(_tilebits.plan_bits(req.plan, req.plan_extra, B, H, L, S), L, S)
            except Exception:
                iv = None
            if not _keep_rows(req, iv):
                return ["a plan whose rows are not one stretch of keys each (nor a few), the same for every head"]
        if req.dense_mask is not None and not _rows_known(req) and \
                not _keep_rows(req, _bool_row_intervals(req.dense_mask, L, S, few=True)):  # the call's own rows
            return [ROWS_REFUSAL]
        if not _rows_known(req):
            mask = req.mask if req.mask is not None else _FULL
            iv = _row_intervals(mask, B, L, S)
            if iv is None and type(mask) not in _CLOSED_FORM:  # a user's mask_mod (or & | ~ of one): its rows
                try:  # evaluated at every point (a few rows), or read off its tile map, cached by content
                    if B * H * L * S <= _DENSE_POINTS:
                        a = _dense_points(mask, B, H, L, S)
                        iv = None if a is None else _bool_row_intervals(a, L, S, few=True)
                    else:
                        iv = _tilebits.row_intervals(_tilebits.tile_bits(mask, B, H, L, S), L, S)
                except Exception:  # a mod that cannot run so: the other kernels evaluate it their way
                    iv = None
            if not _keep_rows(req, iv):
                return [f"mask {req.mask!r} is not one stretch of keys per row (nor a few), the same for every head"]
        if not _native.available():
            return [_native.unavailable_reason()]
        return []

    def auto_reason(self, req: Request, passed) -> str:
        B, H, L, S, D, Dv, Hkv = req.shape
        return (f"a decode step (L = {L} <= {DECODE_ROWS}, no gradient): attnkit's compiled decode entry, "
                f"K/V read once per group{' and split over the threads' if S >= 2048 else ''}")

    def why(self, req: Request) -> str:
        B, H, L, S, D, Dv, Hkv = req.shape
        prog = req.memo.get("score_prog")
        mod = (f", the score_mod run as a {len(prog.ops)}-instruction program" if prog is not None
               else ", ALiBi's bias added" if _alibi(req) is not None else "")
        order = ""
        kv_bytes = B * Hkv * S * (D + Dv) * req.k.element_size()
        if H // Hkv * L <= _native.STREAM_ROWS and kv_bytes >= _native.STREAM_BYTES:  # (the rule's line)
            x = _calibrate.crossovers()
            order = ("; K/V of >= 8 MB read register-blocked (measured faster here: " + x.source + ")"
                     if x.decode_order == "blocked" else "; K/V of >= 8 MB read in the order the kernel learns on "
                     "this call shape's first calls, timing both (" + ("register-blocked not faster here by "
                     "calibration" if x.decode_order == "memory" else "today's rule") + ")")
        return (f"attnkit's compiled kernel, decode entry ({_native.isa()}): {H // Hkv * L} rows per kv head "
                f"against its K/V read once, split-K over the threads with an exact lse merge{mod}{order}")

    def run(self, req: Request):
        stretches = req.memo.get("row_stretches")
        if stretches is not None:
            return self._run_stretches(req, stretches)
        lo, hi = req.memo["row_intervals"]
        return _native.decode(_rows(req.q), _rows(req.k), _rows(req.v), lo, hi, req.scale, need_lse=req.need_lse,
                              alibi=_alibi(req), prog=req.memo.get("score_prog"), rounded=True)

    @staticmethod
    def _run_stretches(req: Request, stretches):
        """Rows of a few stretches of keys (:func:`_bool_row_stretches`'s planes): one decode call, each row
        seeing the union of its stretches (one online softmax over them, K and V read once). A row in no stretch:
        out 0, lse −inf; NaN in a key it sees reaches the row."""
        return _native.decode(_rows(req.q), _rows(req.k), _rows(req.v), stretches[0], stretches[1], req.scale,
                              need_lse=req.need_lse, alibi=_alibi(req), prog=req.memo.get("score_prog"), rounded=True)

    def replay(self, req: Request, user_mask):
        """The prepared call for :mod:`attnkit._fast` (see ``sdpa.Fused.replay``): the row intervals of this
        signature's built-in mask, fixed; no NaN check needed (the kernel propagates NaN itself)."""
        if req.need_lse or req.weight_heads is not None or req.sinks is not None:
            return None
        if type(user_mask) is torch.Tensor:
            return self._replay_bool(req, user_mask)
        st = req.memo.get("row_stretches")  # (this signature's rows, fixed: its stretch planes, or one interval each)
        lo, hi = st if st is not None else req.memo["row_intervals"]
        default = req.scale
        # the record for this signature, built once: a call writes strides, pointers and scale (rows read in place)
        step = _native.decode_step(_rows(req.q), _rows(req.k), _rows(req.v), lo, hi, rounded=True,
                                   **_kept_scores(req))

        def run(q, k, v, mask, scale):
            out = step(q, k, v, default if scale is None else scale)
            return out

        return run

    def replay_family(self, req: Request, user_mask, causal: bool):
        """The prepared call for every cache length S of this signature (:mod:`attnkit._fast`: a decode loop
        brings one key more every step, a new signature each time). Nothing this row's decision reads depends on
        S but the mask's row intervals and a score_mod's program; per new S the call re-derives what does, from
        the *user's* mask and ``causal`` (the request's mask was simplified for its own S: a window as wide as
        the cache is plain causal, causal over one query row no mask), as ``make_request`` would: the mask and
        score_mod validated at S (an invalid call returns None: the full path raises its error), the row
        intervals at S (a built-in mask's, cached; not one stretch per row: None), the program traced for up to
        ``max_s`` keys (beyond: None). None here for what only the exact signature fixes (a ``mask_mod``'s rows
        read off its tile map, a plan, a tensor mask) and for rows of a few stretches (each call the full path)."""
        if req.need_lse or req.weight_heads is not None or req.sinks is not None:
            return None
        if type(user_mask) is torch.Tensor:  # its family is its shape without S (attnkit._fast._family)
            return self._replay_bool(req, user_mask, any_s=True)
        parts = [_masks.causal()] if causal else []
        if user_mask is not None and type(user_mask) not in _CLOSED_FORM:
            return self._replay_mod_family(req, user_mask, causal)
        if "row_stretches" in req.memo:
            return None  # (a built-in's rows are one stretch: not reached)
        if user_mask is not None:
            parts.append(user_mask)
        mask = parts[0] if len(parts) == 1 else _masks.And(*parts) if parts else _FULL
        prog = req.memo.get("score_prog")
        alibi = _alibi(req)
        if req.score_mod is not None and prog is None and alibi is None:
            return None
        B, H, L, *_ = req.shape
        lo0, hi0 = req.memo["row_intervals"]
        max_s = prog.max_s if prog is not None else None
        default, shape, sm = req.scale, lo0.shape, req.score_mod
        checks = [c.validate for c in (mask, sm) if isinstance(c, (_masks.Mask, _score_mods.ScoreMod))]
        # the whole cache at every S (no mask; causal over one query row): key intervals [0, huge), which the kernel
        # clamps to [0, S), fixed for every step (no intervals computed per S)
        whole = all(type(p) is _masks.Full or (type(p) is _masks.Causal and p.align == "bottom_right" and L == 1)
                    for p in parts)
        if whole:
            lo0 = torch.zeros(1, L, dtype=torch.int32)
            hi0 = torch.full((1, L), torch.iinfo(torch.int32).max, dtype=torch.int32)
        step = _native.decode_step(_rows(req.q), _rows(req.k), _rows(req.v), lo0, hi0,
                                   alibi=None if alibi is None else alibi.detach().clone(), prog=prog, rounded=True)
        # a closed-form mask's rows for a block of BLOCK key counts at once (one NumPy evaluation per BLOCK steps, not
        # ~15 µs of small array ops per step); the block is this family's own (a loop brings S, S + 1, ...)
        batched = bool(parts) and all(hasattr(p, "_row_edges") for p in parts)
        block: list = [None]

        def rows_at(S: int):
            b = block[0]
            if b is None or not b[0] <= S < b[0] + _BLOCK:
                b = block[0] = (S, *_edges_block(parts, L, S))
            i = S - b[0]
            return torch.from_numpy(b[1][i:i + 1]), torch.from_numpy(b[2][i:i + 1])

        def run(q, k, v, user, scale):
            S = k.shape[2]
            if (max_s is not None and S > max_s) or v.shape[2] != S or S == 0:
                return None
            try:
                for check in checks:
                    check(B, H, L, S)
            except (ValueError, TypeError):
                return None
            if whole:
                out = step(q, k, v, default if scale is None else scale)
            elif batched:
                out = step(q, k, v, default if scale is None else scale, *rows_at(S))
            else:
                iv = _row_intervals(mask, B, L, S)
                if iv is None or iv[0].shape != shape:
                    return None
                out = step(q, k, v, default if scale is None else scale, iv[0], iv[1])
            return out

        return run


    def _replay_bool(self, req: Request, user_mask: torch.Tensor, any_s: bool = False):
        """The prepared call for a bool tensor mask (the call's own, passed at every call: its rows are read off
        *that* call's mask, never remembered, so a mask edited in place between calls is read as it is then); a
        row that is not one stretch of keys returns None (the full path). ``any_s``: for every cache length S of
        the signature (a decode loop's mask gains a key every step; its shape without S is the family's)."""
        unprepared = req.score_mod is not None and "score_prog" not in req.memo and _alibi(req) is None
        if user_mask.dtype is not torch.bool or unprepared:
            return None
        B, H, L, S0, *_ = req.shape
        lo0, hi0 = _first_rows(req)
        prog = req.memo.get("score_prog")
        alibi = _alibi(req)
        max_s = prog.max_s if prog is not None else None
        default, shape = req.scale, lo0.shape
        spans = shape[0] == 1  # one interval for every row may come as two ints (the step writes them in place)
        step = _native.decode_step(_rows(req.q), _rows(req.k), _rows(req.v), lo0, hi0,
                                   alibi=None if alibi is None else alibi.detach().clone(), prog=prog, rounded=True)
        few = _FewStretches(shape, alibi, prog)

        def run(q, k, v, mask, scale):
            S = k.shape[2]
            if v.shape[2] != S or (S != S0 and (not any_s or (max_s is not None and S > max_s) or S == 0)):
                return None
            if mask.dim() and mask.shape[-1] not in (1, S):
                return None  # (the full path says what is wrong with it)
            sc = default if scale is None else scale
            iv = _bool_row_intervals(mask, L, S, spans, few=True)  # (any rank up to 4: read as (1, ..., S))
            if iv is None:
                return None
            if isinstance(iv, _Planes):  # rows of a few stretches (sinks and a window): their planes
                out = few(q, k, v, sc, iv.planes)
                if out is None:
                    return None
            elif type(iv[0]) is not int and iv[0].shape != shape:
                return None
            else:
                out = step(q, k, v, sc, iv[0], iv[1])
            return out

        return run

    def _replay_mod_family(self, req: Request, user_mask, causal: bool):
        """:meth:`replay_family` for a user's ``mask_mod`` (bare, or in ``&`` ``|`` ``~``), whose family is its code
        whatever values it captures (:func:`attnkit._fast._family`): each call's *own* mod is evaluated at every
        point of the call (:func:`_dense_row_intervals`), so nothing learned from an earlier step's mod is reused
        but the decision. A mod with no key never gets here (:func:`attnkit._fast._signature`)."""
        is_plan = isinstance(user_mask, _plans.BlockPlan)
        if isinstance(user_mask, _masks.Mask) and not _mods.has_code(user_mask.cache_key()):
            return None  # a built-in's subclass: only the exact signature fixes it
        if not (is_plan or isinstance(user_mask, (_masks.Mask, types.FunctionType))):
            return None
        B, H, L, *_ = req.shape
        lo0, hi0 = _first_rows(req)
        prog = req.memo.get("score_prog")
        alibi = _alibi(req)
        if req.score_mod is not None and prog is None and alibi is None:
            return None
        max_s = prog.max_s if prog is not None else None
        default, shape, sm = req.scale, lo0.shape, req.score_mod
        few = _FewStretches(shape, alibi, prog)
        check = sm.validate if isinstance(sm, _score_mods.ScoreMod) else None
        spans = shape[0] == 1  # one interval for every row may come as two ints (the step writes them in place)
        step = _native.decode_step(_rows(req.q), _rows(req.k), _rows(req.v), lo0, hi0,
                                   alibi=None if alibi is None else alibi.detach().clone(), prog=prog, rounded=True)
        causal_mask = _masks.causal() if causal and L > 1 else None  # (over one query row causal is no mask)

        def rows(k, v, user):
            """This call's row intervals, from its own mod (or plan), or None (the full path decides)."""
            S = k.shape[2]
            if (max_s is not None and S > max_s) or v.shape[2] != S or S == 0:
                return None
            try:
                if check is not None:
                    check(B, H, L, S)
                if is_plan:  # a new BlockMask every step (FlexAttention's decode loop): its own blocks and mod
                    user.check(B, H, L, S)
                    a = _dense_points(_plan_mask(user, causal_mask), B, H, L, S)
                elif causal_mask is None and type(user) is types.FunctionType and _mods.broadcast_safe(
                        user, False, B, H, L, S):  # (known per code: one lookup) the mod itself, on the indices
                    a = _dense_points(user, B, H, L, S, fn=user)
                else:
                    m = user if isinstance(user, _masks.Mask) else _masks.FromMod(user)
                    if causal_mask is not None:
                        m = _masks.And(causal_mask, m)
                    a = _dense_points(m, B, H, L, S)
                iv = None if a is None else _bool_row_intervals(a, L, S, spans, few=True)
                if isinstance(iv, _Planes):  # a few stretches (sinks and a window)
                    return iv
            except Exception:  # whatever the mod raises: the full path raises it, with its context
                return None
            if iv is None or (type(iv[0]) is not int and iv[0].shape != shape):
                return None
            return iv  # (two ints, or two tensors no one else holds: safe to keep for run_exact)

        def call(q, k, v, sc, iv):
            """The kernel on rows ``iv``: one stretch each (lo, hi), or a few (their planes, :class:`_Planes`)."""
            if isinstance(iv, _Planes):
                return few(q, k, v, sc, iv.planes)
            return step(q, k, v, sc, iv[0], iv[1])

        def run(q, k, v, user, scale):
            iv = rows(k, v, user)
            out = None if iv is None else call(q, k, v, default if scale is None else scale, iv)
            if out is None:
                return None
            return out

        def exact(q, k, v, user):
            """The prepared call for this call's exact signature (its mod's content and S fixed: the rows too), for
            the next calls with the same mod — a model's other layers in this step — or None."""
            iv = rows(k, v, user)
            if iv is None or (isinstance(iv, _Planes) and not few.fits(iv.planes)):
                return None

            def run_exact(q, k, v, mask, scale):
                out = call(q, k, v, default if scale is None else scale, iv)
                return out

            return run_exact

        run.exact = exact  # type: ignore[attr-defined]
        return run


def _few_planes(a: torch.Tensor, L: int, S: int):
    """:class:`_Planes` of ``a``'s rows of a few stretches (:func:`_bool_row_stretches`), or None."""
    st = _bool_row_stretches(a, L, S)
    return None if st is None else _Planes(st)


class _Planes:
    """A call's rows as stretch planes (:func:`_bool_row_stretches`), told apart from one interval per row."""

    __slots__ = ("planes",)

    def __init__(self, planes):
        self.planes = planes


class _FewStretches:
    """A replay's rows of a few stretches of keys each (:func:`_bool_row_stretches`'s planes): one decode call on
    a record prepared once (on first use) for planes of the replay's rows (the first call's row shape)."""

    def __init__(self, shape, alibi, prog):
        self.shape, self.prog = tuple(shape), prog
        self.alibi = None if alibi is None else alibi.detach().clone()
        self.step: Callable | None = None  # (made from the first call that needs it: no tensor of req kept)

    def fits(self, planes) -> bool:
        return planes is not None and tuple(planes[0].shape) == (MAX_STRETCHES, *self.shape)

    def __call__(self, q, k, v, scale, planes):
        """The output (in q's dtype, rounded by the kernel), or None where the rows are more stretches or of other
        shapes."""
        if not self.fits(planes):
            return None
        step = self.step
        if step is None:
            step = self.step = _native.decode_step(_rows(q), _rows(k), _rows(v), planes[0], planes[1],
                                                   alibi=self.alibi, prog=self.prog, rounded=True)
        return step(q, k, v, scale, planes[0], planes[1])


NATIVE_DECODE = NativeDecode()

_BLOCK = 64  # key counts per evaluation of a decode family's closed-form rows


def _edges_block(parts, L: int, S0: int):
    """The row intervals of the intersection of ``parts`` (closed-form masks: ``_row_edges``) at each key count
    S0 … S0 + _BLOCK - 1: (lo, hi), int32 C-contiguous (_BLOCK, L), row i for S0 + i — what ``row_intervals`` of
    their ``&`` gives at that S (the intersection of clamped edges is the clamp of the intersection)."""
    Ss = np.arange(S0, S0 + _BLOCK, dtype=np.int64).reshape(-1, 1)
    lo, hi = parts[0]._row_edges(L, Ss)
    for p in parts[1:]:
        a, b = p._row_edges(L, Ss)
        lo, hi = np.maximum(lo, a), np.minimum(hi, b)
    lo, hi = np.broadcast_arrays(lo, hi)
    return (np.clip(lo, 0, Ss).astype(np.int32), np.clip(hi, 0, Ss).astype(np.int32))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dimension contiguous (the kernel reads rows in place; other strides as they are)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def native_unfit(req: Request) -> str | None:
    """The first reason the compiled kernel cannot run ``req`` (None: it can; see :meth:`Native.not_supported`)."""
    why = NATIVE.not_supported(req)
    return why[0] if why else None


# The kernel's backward of a few query rows (csrc/attn_decode.h, rows_backward): the g * L rows of a kv head as one
# unit, for L <= FEW_ROWS_GRAD_L and g * L <= 64, a mask of row intervals, no score_mod program whose tables want a
# gradient (those run the key-tile backward)
FEW_ROWS_GRAD_L = 16


def few_rows_backward(req: Request) -> bool:
    """Whether the kernel's backward of ``req`` (once :meth:`Native.not_supported` has passed it) is its few-rows
    one (the rule of ``rows_backward_fits`` in csrc/attn_decode.h)."""
    H, L, Hkv = req.q.shape[1], req.q.shape[2], req.k.shape[1]
    return (1 <= L <= FEW_ROWS_GRAD_L and H % Hkv == 0 and H // Hkv * L <= 64 and "row_intervals" in req.memo
            and "tile_bits" not in req.memo and not getattr(req.memo.get("score_prog"), "wants_grads", False))


def _mask_of(req: Request):
    """(lo, hi, tile map or None) for the kernel: the mask's row intervals, or every key [0, S) bounded by
    its tile map."""
    tiles = req.memo.get("tile_bits")
    if tiles is None:
        lo, hi = req.memo["row_intervals"]
        return lo, hi, None
    L, S = req.q.shape[2], req.k.shape[2]
    return torch.zeros(1, L, dtype=torch.int32), torch.full((1, L), S, dtype=torch.int32), tiles


class _NativeAttention(torch.autograd.Function):
    """The compiled kernel's forward and backward. Inputs: q, k, v, the request, then every tensor the
    score_mod's program reads that requires grad (their gradients come back from the kernel). Saves
    (q, k, v, out before rounding, lse); the backward recomputes tiles."""

    @staticmethod
    def forward(ctx, q, k, v, req: Request, *captured):
        lo, hi, tiles = _mask_of(req)
        if tiles is None and q.shape[2] <= DECODE_ROWS:
            # a few query rows: the decode entry's forward (its rows packed per kv head; the forward's query block
            # of 64 columns did the work of 8 rows for one at AVX2), out kept in fp32 for the backward
            out_hi, lse = _native.decode(_rows(q), _rows(k), _rows(v), lo, hi, req.scale, need_lse=True,
                                         alibi=_alibi(req), prog=req.memo.get("score_prog"))
            out = None if q.dtype is torch.float32 else out_hi.to(q.dtype)
        else:
            # bf16 / fp16: the kernel writes out in q's dtype beside the fp32 out it keeps for the backward
            out_hi, lse, out = _native.forward(q, k, v, lo, hi, req.scale, alibi=_alibi(req), tiles=tiles,
                                               prog=req.memo.get("score_prog"), rounded=True)
        ctx.save_for_backward(q, k, v, out_hi, lse)
        ctx.req, ctx.captured = req, captured
        ctx.set_materialize_grads(False)  # an unused lse gives dlse = None: no extra work
        return (out_hi if out is None else out), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return _backward(ctx.req, list(ctx.captured), q, k, v, out, lse, dout, dlse)


def _backward(req: Request, captured: list, q, k, v, out, lse, dout, dlse):
    """:class:`_NativeAttention`'s backward (and :class:`_NativeStep`'s where its prepared one does not fit): the
    gradients of q, k, v, None for the request, then those of the ``captured`` tensors."""
    if torch.is_grad_enabled():  # create_graph: the gradients must be a graph (a double backward reads them)
        gq, gk, gv, _, gcap = eager.graph_backward(req, q, k, v, None, captured, dout, dlse)
        return (gq, gk, gv, None, *gcap)
    if dout is None:
        dout = torch.zeros_like(out)
    # Rows where exp(s - lse) is not exact (scores all at finfo.min / -1e9: issue 18) leave the kernel:
    # their dout and dlse are zeroed, so its share there is exactly 0, and exact_rows_backward adds theirs.
    dout_all, dlse_all = dout, dlse
    rows, dout, dlse = _softmax.split_inexact(lse, dout, dlse)
    fix = rows is not None
    lo, hi, tiles = _mask_of(req)
    prog = req.memo.get("score_prog")
    # grads in q's dtype from the kernel (rounded once) unless the exact-rows fix adds to them in fp32 first
    dq, dk, dv, tgrads = _native.backward(q, k, v, lo, hi, req.scale, out, lse, dout, dlse,
                                          alibi=_alibi(req), tiles=tiles, prog=prog, rounded=not fix)
    dcap: list = [None] * len(captured)
    if prog is not None and tgrads:  # the learnable tables' gradients, to the tensors autograd routes
        by_id = {id(t): g for t, g in zip(prog.grad_of, tgrads, strict=True) if t is not None}
        dcap = [by_id.get(id(t)) for t in captured]
    if fix:
        rq, rk, rv, rext = _tiles.exact_rows_backward(req, rows, dout_all, dlse_all, captured)
        dq, dk, dv = dq + rq, dk + rk, dv + rv
        dcap = [b if a is None else a if b is None else a + b.to(a.dtype)
                for a, b in zip(dcap, rext, strict=True)]
    dcap = [None if g is None else g.to(t.dtype) for g, t in zip(dcap, captured, strict=True)]
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, *dcap)


class _NativeStep(torch.autograd.Function):
    """The compiled kernel's forward and backward for a replayed call signature that wants gradients
    (:meth:`Native.replay`): both prepared once (``_native.forward_step`` / ``decode_step`` and
    ``_native.backward_step``), so a call runs no request and no record building (at a decode step's size that
    Python cost more than the kernel). Inputs: q, k, v, then the prepared pair and the scale. A backward the
    prepared one does not take — a graph of gradients (create_graph), a gradient in another dtype, rows whose
    ``exp(s - lse)`` is inexact — runs :func:`_backward` on the request rebuilt by ``pair.request``."""

    @staticmethod
    def forward(ctx, q, k, v, pair, scale):
        if q.dtype is torch.float32:
            out, lse = pair.forward(q, k, v, scale)
            out_r = out
        else:  # (out in q's dtype rounded by the kernel beside the fp32 out the backward reads)
            out, lse, out_r = pair.forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pair, ctx.scale = pair, scale
        ctx.set_materialize_grads(False)
        return out_r

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            return None, None, None, None, None
        if torch.is_grad_enabled() or dout.dtype is not q.dtype or _softmax.any_inexact(lse):
            dq, dk, dv = _backward(ctx.pair.request(q, k, v, ctx.scale), [], q, k, v, out, lse, dout, None)[:3]
        else:
            dq, dk, dv = ctx.pair.backward(q, k, v, out, lse, dout, ctx.scale)
        return dq, dk, dv, None, None


def _bare(req: Request) -> Request:
    """``req`` without its q, k, v (a replay's record of its first call keeps no tensor of it alive)."""
    return dataclasses.replace(req, q=_NOTHING, k=_NOTHING, v=_NOTHING)


def _step_pair(req: Request, base: Request, alibi) -> _StepPair | None:
    """The prepared forward and backward of ``req``'s signature (:class:`_NativeStep`), or None where the
    prepared calls do not take it (q, k, v in different dtypes; a program whose tables want gradients)."""
    q, k, v = req.q, req.k, req.v
    prog = req.memo.get("score_prog")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _native._DTYPE_CODE or \
            getattr(prog, "wants_grads", False):
        return None
    lo, hi, tiles = _mask_of(req)
    slopes = None if alibi is None else alibi.detach().clone()  # (the record outlives the call: a copy)
    half = q.dtype is not torch.float32
    with torch.no_grad():
        if tiles is None and q.shape[2] <= DECODE_ROWS:  # a few query rows: the decode entry, as the forward above
            fwd = _native.decode_step(_rows(q), _rows(k), _rows(v), lo.contiguous(), hi.contiguous(), alibi=slopes,
                                      prog=prog, with_lse=True, beside=half)
        else:
            fwd = _native.forward_step(q, k, v, lo, hi, tiles, alibi=slopes, prog=prog, with_lse=True, beside=half)
        bwd = _native.backward_step(q, k, v, lo, hi, tiles, alibi=slopes, prog=prog, rounded=True)
    return _StepPair(fwd, bwd, base)


class _StepPair:
    """What :class:`_NativeStep` replays for one signature: ``forward(q, k, v, scale) -> (out fp32, lse)`` (bf16 /
    fp16: ``(out fp32, lse, out in q's dtype)``),
    ``backward(q, k, v, out, lse, dout, scale) -> (dq, dk, dv)`` in q's dtype, and ``request(q, k, v, scale)``,
    the signature's first request around these tensors (for the backward's general path)."""

    __slots__ = ("backward", "base", "forward")

    def __init__(self, forward, backward, base: Request):
        self.forward, self.backward, self.base = forward, backward, base

    def request(self, q, k, v, scale: float) -> Request:
        return dataclasses.replace(self.base, q=q, k=k, v=v, scale=scale)
