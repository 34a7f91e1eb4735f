"""``backend="tiled"``: FlashAttention's algorithm (Dao et al. 2022; FA2, Dao 2023) over PyTorch ops.

Exact attention, forward and backward, in O(L + S) extra memory, skipping the
tiles a mask empties. Layers (as in flash_attn_triton.py):

    _tiled_fused           the loops over query blocks and key runs (the "kernel"); per run
                           one call of torch's private CPU flash kernel (_flash_cpu), merged
                           by log-sum-exp (_softmax.merge)
    _tiled_plain           the same loops in plain torch ops (_softmax.online_step): any
                           score_mod, gradients into captured tensors and float masks, any device
    choose_worker(req)     which of the two runs this call, and why (reported by attnkit.dispatch)
    _launch                the work list from the block plan (_worklist)
    _TiledAttention        torch.autograd.Function: saves (q, k, v, out, lse) only
    run(req, worker)       the backend entry point

Tiling, per query block of ``bm`` rows (GQA: the ``g = H // Hkv`` query heads
sharing a kv head are stacked into the GEMM's M dimension, so K/V are never
copied)::

               keys ─────────────────────────────►
             ┌──────┬──────┬──────┬──────┬──────┐
    q block  │ skip │  P   │  F   │  F   │  P   │   P partial: mask_mod on that tile
    (bm rows)└──────┴──────┴──────┴──────┴──────┘   F full: no mask evaluated
                    └──── one run: one GEMM ────┘   skip: empty tile, never computed

The online softmax and the log-sum-exp merge are ``backends._softmax`` (the only copy).

Caveats vs the other backends: no dropout (``auto`` sends dropout to eager).
bf16: the fused worker keeps the GEMM inputs in bf16 with fp32 scores,
statistics and accumulators inside the kernel (as torch SDPA); a query block
with several runs gets each run's output rounded once to bf16 before the
fp32 log-sum-exp merge (one rounding per run; tests bound the total at 2× SDPA's
error). fp16 runs the kernel in fp32 (``TileContext.kernel_dtype``: faster on CPUs, and
the backward's delta is then taken from the unrounded output). The plain-op loop upcasts
q, k, v once to fp32 (O(L + S) memory).

Block sizes: ``BLOCK_M`` × ``BLOCK_N`` tiles; the plain-op loop caps runs at
``MAX_RUN`` keys (the fused kernel tiles internally, so its runs are uncapped);
override with ``ATTNKIT_TILED_BLOCKS="bm,bn[,max_run]"`` or the ``block_sizes``
context manager (tests sweep several).
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict

import torch

from .. import _scoreprog
from .. import masks as _masks
from .. import score_mods as _score_mods
from . import _flash_cpu, _native, _softmax, _tilebits, _tiled_fused, _tiled_plain, _tiles, _worklist
from ._base import Request
from ._tiled_ctx import TileContext, additive_mod
from ._tiles import has_nan

__all__ = ["NAME", "unsupported", "choose_worker", "partial_fraction", "run", "block_sizes", "context"]

NAME = "tiled"

BLOCK_M = 64
BLOCK_N = 64
# Keys per GEMM in the plain worker: large enough to amortise Python per step, small
# enough that a score tile of (B·H·bm × MAX_RUN) stays cache-friendly.
MAX_RUN = 1024
# False sends every request to the plain worker (tests run every worker).
FUSED = True
# False keeps requests off attnkit's compiled kernel (backends._native; tests compare the workers).
NATIVE = True
# Largest (rows × keys) mask tile the fused worker builds for one group of query blocks.
FUSED_MASK_ELEMS = 1 << 22


def _sizes():
    env = os.environ.get("ATTNKIT_TILED_BLOCKS")
    if env:
        parts = [int(x) for x in env.split(",")]
        bm, bn = parts[0], parts[1]
        return bm, bn, parts[2] if len(parts) > 2 else max(MAX_RUN, bn)
    return BLOCK_M, BLOCK_N, max(MAX_RUN, BLOCK_N)


@contextlib.contextmanager
def block_sizes(bm: int, bn: int, max_run: int | None = None):
    """Temporarily use ``bm × bn`` tiles (and runs of at most ``max_run`` keys)."""
    global BLOCK_M, BLOCK_N, MAX_RUN
    saved = BLOCK_M, BLOCK_N, MAX_RUN
    BLOCK_M, BLOCK_N, MAX_RUN = bm, bn, (max_run if max_run is not None else max(MAX_RUN, bn))
    try:
        yield
    finally:
        BLOCK_M, BLOCK_N, MAX_RUN = saved


def unsupported(req: Request) -> str | None:
    if req.dropout_p > 0:
        return "the tiled backend has no dropout (use backend='eager')"
    if req.grad_hidden:
        return ("the score_mod reads a tensor that requires grad where attnkit cannot find it (not in its "
                "closure, defaults or globals), so the tiled backward could not return its gradient "
                "(use backend='eager', or capture the tensor directly in the function)")
    return None


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
    if key in _IV_CACHE:
        _IV_CACHE.move_to_end(key)
        return _IV_CACHE[key]
    iv = mask.row_intervals(B, L, S)
    _IV_CACHE[key] = iv
    if len(_IV_CACHE) > _IV_CACHE_MAX:
        _IV_CACHE.popitem(last=False)
    return iv


_BF16_HW: bool | None = None


def _bf16_hardware() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 / AMX) that torch's kernels use."""
    global _BF16_HW
    if _BF16_HW is None:
        try:
            _BF16_HW = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            _BF16_HW = False
    return _BF16_HW


def native_unfit(req: Request) -> str | None:
    """Why attnkit's compiled kernel cannot run this call (None: it can). On success the mask's row
    intervals (a built-in mask that is one stretch of keys per row) are left in ``req.memo["row_intervals"]``,
    or, for any other mask, its tile map with each partial tile's bits in ``req.memo["tile_bits"]``."""
    if not NATIVE:
        return "the compiled kernel is switched off (tiled.NATIVE = False)"
    if req.q.device.type != "cpu":
        return f"tensors on {req.q.device.type} (the compiled kernel is CPU-only)"
    if req.q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{req.q.dtype} (the compiled kernel computes in fp32; float64 stays in float64)"
    if req.q.dtype == torch.bfloat16 and _bf16_hardware():
        # measured (`python benchmarks/kernel.py --dtype bf16 --cases dense,causal`, a CPU with AMX): torch's
        # bf16 kernel per run ("before") 2.2-2.5x the compiled kernel's (fp32 inside) forward speed at L = 4096
        return "bfloat16 on a CPU that multiplies bf16 in hardware (torch's kernel keeps bf16 GEMMs; ours is fp32)"
    if req.bias is not None or req.dense_mask is not None:
        return "a tensor mask (the compiled kernel takes a mask as row intervals)"
    if req.plan is not None and (req.plan.block[0] % _tilebits.TILE or req.plan.block[1] % _tilebits.TILE):
        return f"an explicit plan of {req.plan.block[0]} x {req.plan.block[1]} tiles (the kernel's are 64 x 64)"
    if torch.is_grad_enabled() and ((req.bias is not None and req.bias.requires_grad) or req.grad_hidden):
        return "gradients into a float mask or into tensors the score_mod reads where attnkit cannot find them"
    B, H, L, S, *_ = req.shape
    if req.score_mod is not None and _alibi(req) is None and "score_prog" not in req.memo:
        try:
            prog = _scoreprog.compile_score_mod(req.score_mod, B, H, L, S)
        except _scoreprog.Refused as e:
            return f"a score_mod the kernel's programs do not cover: {e}"
        learned = {id(t) for t in prog.grad_of if t is not None}
        if any(id(t) not in learned for t in req.grad_tensors):
            return ("a score_mod tensor that requires grad but is not read as a table (e.g. a copy made inside the "
                    "score_mod): the kernel could not return its gradient")
        req.memo["score_prog"] = prog
    if req.plan is not None and "tile_bits" not in req.memo:
        try:  # its tiles as given (a BlockMask's), the mask evaluated in the partial ones
            req.memo["tile_bits"] = _tilebits.plan_bits(req.plan, req.plan_extra, B, H, L, S)
        except Exception as e:
            return (f"the plan's mask could not be evaluated on stacked 64 x 64 tiles for the kernel's tile map "
                    f"({type(e).__name__}: {e})")
    if "row_intervals" not in req.memo and "tile_bits" not in req.memo:
        iv = _row_intervals(req.mask if req.mask is not None else _FULL, B, L, S)
        if iv is not None:
            req.memo["row_intervals"] = iv
        else:
            try:
                req.memo["tile_bits"] = _tilebits.tile_bits(req.mask if req.mask is not None else _FULL, B, H, L, S)
            except Exception as e:  # a mod that cannot run on stacked tiles: torch's kernels evaluate it per run
                return (f"mask {req.mask!r} could not be evaluated on stacked 64 x 64 tiles for the kernel's tile map "
                        f"({type(e).__name__}: {e})")
    if not _native.available():
        _native.warn_missing()
        return _native.unavailable_reason()
    return None


def choose_worker(req: Request) -> tuple[str, str]:
    """``("native", why)`` when attnkit's compiled kernel can run this call, else ``("fused", why)``
    when torch's private CPU flash kernel can run every run of it exactly, else ``("plain", why not)``.
    The first reason that applies is given."""
    if not FUSED:
        return "plain", "the fused worker is switched off (tiled.FUSED = False)"
    why_not = native_unfit(req)
    if why_not is None:
        tb = req.memo.get("tile_bits")
        if tb is None:
            how = "the mask's row intervals, empty tiles skipped, full tiles unmasked"
        else:
            how = (f"the mask's tile map ({100 * tb.computed_fraction:.0f}% of 64 x 64 tiles computed, "
                   f"{tb.partial_tiles} partial tiles masked by their own bits)")
        prog = req.memo.get("score_prog")
        if prog is not None:
            how += f", the score_mod run as a {len(prog.ops)}-instruction program"
        return "native", f"attnkit's compiled kernel ({_native.isa()}): block-sparse FlashAttention-2 over {how}"
    worker, why = _fallback_worker(req, why_not)
    return worker, (f"{why} (not the compiled kernel: {why_not})" if worker == "plain" else why)


def _fallback_worker(req: Request, why_not: str) -> tuple[str, str]:
    """The worker for a call the compiled kernel cannot run (``why_not``): torch's flash kernel per run, or
    plain torch ops."""
    if req.score_mod is not None and not additive_mod(req.score_mod):
        return "plain", "a score_mod that is not an additive bias (the fused kernel takes only a bias tile)"
    if req.q.shape[-1] != req.v.shape[-1]:
        return "plain", "D != Dv (the fused kernel needs equal head dims)"
    if req.q.device.type != "cpu":
        return "plain", f"tensors on {req.q.device.type} (the fused kernel is CPU-only)"
    if req.extra_grads():
        return "plain", "gradients into a float mask or score_mod tensors (differentiated tile by tile)"
    if not _flash_cpu.available():
        return "plain", f"torch's private CPU flash kernel is unavailable ({_flash_cpu.unavailable_reason()})"
    if has_nan(req.q, req.k, req.v):
        # the kernel outputs 0 on a row whose scores hold NaN; the plain worker propagates NaN
        return "plain", "NaN in q, k or v (the fused kernel would hide it)"
    if _tiled_fused.causal_pieces(req, req.plan) is not None:
        return "fused", ("torch's CPU flash kernel with its own causal block skipping (causal alone: "
                         f"one call per query-head group and key range, merged by log-sum-exp; not the compiled "
                         f"kernel: {why_not})")
    return "fused", ("torch's CPU flash kernel per run of keys, merged by log-sum-exp "
                     f"(not the compiled kernel: {why_not})")


def partial_fraction(req: Request) -> float:
    """Fraction of this call's tiles that the user bool mask leaves partial (nothing to skip
    there). Kept in the request's memo, so the run that may follow reuses the same pass."""
    B, H, L, S, *_ = req.shape
    bm, bn, _ = _sizes()
    if req.dense_mask is None:
        return 0.0
    grid = _worklist.dense_kinds(req.dense_mask, L, S, bm, bn, req.memo)
    return float((grid == _worklist.PARTIAL).float().mean()) if grid.numel() else 0.0


class _TiledAttention(torch.autograd.Function):
    """Saves (q, k, v, out, lse) and recomputes tiles in backward.

    Inputs: q, k, v, the float mask (or None), the context, then every tensor the
    score_mod captures that requires grad, so autograd routes their gradients.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, c: TileContext, *captured):
        if c.worker == "native":
            lo, hi, tiles = _native_mask(c.req)
            out_hi, lse = _native.forward(q, k, v, lo, hi, c.req.scale, alibi=_alibi(c.req), tiles=tiles,
                                          prog=c.req.memo.get("score_prog"))
            out = out_hi.to(q.dtype)
            ctx.save_for_backward(q, k, v, out_hi, lse)
            ctx.c = c
            ctx.set_materialize_grads(False)
            return out, lse
        # out_hi: the output before its rounding to q's dtype (fp32 for fp16 on either worker and for
        # bf16 on the plain one; the fused worker's bf16 kernel rounds its own output), kept for the
        # backward's delta = rowsum(dO ∘ O): from a rounded O, delta is off by ~2^-11·|dO||O| (fp16),
        # which the cancellation in dp - delta on a peaked row turns into gradient errors many times
        # PyTorch's own fp16 error (issue 18, item 5).
        if c.fused:
            kq, kk, kv = (t.to(c.kernel_dtype) for t in (q, k, v))  # a copy for fp16 only
            fwd = _tiled_fused.causal_forward if c.causal else _tiled_fused.forward
            out_hi, lse = fwd(c, kq, kk, kv)
        else:
            out_hi, lse = _tiled_plain.forward(c, *_tiled_plain.prepare(c, q, k, v))
        out = out_hi.to(q.dtype)
        lse = lse if q.dtype in (torch.float32, torch.float64) else lse.float()
        ctx.save_for_backward(q, k, v, out_hi, lse)
        ctx.c = c
        ctx.set_materialize_grads(False)  # an unused lse gives dlse = None: no extra work
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors  # out: out_hi (see forward)
        c = ctx.c
        if dout is None:
            dout = torch.zeros_like(out)
        dbias, dcap = None, [None] * len(c.captured)
        # Rows where exp(s - lse) is not exact (scores all at finfo.min / -1e9: issue 18) leave
        # the workers (torch's kernel has the flaw inside): their dout and dlse are zeroed, so the
        # workers' share there is exactly 0, and exact_rows_backward adds theirs. O(L) to find.
        rows = _softmax.inexact_rows(lse).flatten(0, 1).any(0)  # (L,)
        fix = bool(rows.any())
        if fix:
            dout_all, dlse_all = dout, dlse
            dout = dout.masked_fill(rows.unsqueeze(-1), 0)
            dlse = None if dlse is None else dlse.masked_fill(rows, 0)
        if c.worker == "native":
            lo, hi, tiles = _native_mask(c.req)
            prog = c.req.memo.get("score_prog")
            dq, dk, dv, tgrads = _native.backward(q, k, v, lo, hi, c.req.scale, out, lse, dout, dlse,
                                                  alibi=_alibi(c.req), tiles=tiles, prog=prog)
            if prog is not None and tgrads:  # the learnable tables' gradients, to the tensors autograd routes
                by_id = {id(t): g for t, g in zip(prog.grad_of, tgrads, strict=True) if t is not None}
                dcap = [by_id.get(id(t)) for t in c.captured]
        elif c.fused and dlse is None:
            bwd = _tiled_fused.causal_backward if c.causal else _tiled_fused.backward
            kd = c.kernel_dtype
            dq, dk, dv = bwd(c, q.to(kd), k.to(kd), v.to(kd), out.to(kd), lse, dout.to(kd))
        else:
            if c.fused:  # a gradient into lse: the plain loop, on a work list cut for it (O(L + S) memory)
                c.plan = _work_list(c.req, "plain", c.plan_bm_bn, c.given)
            dq, dk, dv, dbias, dcap = _tiled_plain.backward(c, *_tiled_plain.prepare(c, q, k, v), out, lse, dout, dlse)
        if fix:
            extra = ([c.req.bias] if c.bias_grad else []) + list(c.captured)
            rq, rk, rv, rext = _tiles.exact_rows_backward(c.req, rows, dout_all, dlse_all, extra)
            dq, dk, dv = dq.to(c.cd) + rq, dk.to(c.cd) + rk, dv.to(c.cd) + rv
            if c.bias_grad:
                dbias = _add(dbias, rext.pop(0))
            dcap = [_add(a, b) for a, b in zip(dcap, rext, strict=True)]
        if dbias is not None:
            dbias = dbias.to(c.req.bias.dtype)
        dcap = [None if g is None else g.to(t.dtype) for g, t in zip(dcap, c.captured, strict=True)]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, None, *dcap)


def _native_mask(req: Request):
    """(lo, hi, tile map or None) for the kernel: the mask's row intervals, or every key [0, S) bounded by
    its tile map."""
    tiles = req.memo.get("tile_bits")
    if tiles is None:
        lo, hi = req.memo["row_intervals"]
        return lo, hi, None
    L, S = req.q.shape[2], req.k.shape[2]
    return torch.zeros(1, L, dtype=torch.int32), torch.full((1, L), S, dtype=torch.int32), tiles


def _alibi(req: Request):
    """ALiBi's (H,) slopes when the call's score_mod is ALiBi with fixed slopes (the compiled kernel adds the
    bias), else None (learned slopes run as a traced program, which returns their gradient)."""
    sm = req.score_mod
    if "score_prog" in req.memo:
        return None
    if isinstance(sm, _score_mods.Alibi) and not (sm.slopes.requires_grad and torch.is_grad_enabled()):
        return sm.slopes
    return None


def _add(a, b):
    """a + b where either may be None (a gradient nobody produced)."""
    return b if a is None else a if b is None else a + b.to(a.dtype)


def _launch(req: Request, worker: str):
    B, H, L, S, D, Dv, Hkv = req.shape
    bm, bn, _ = _sizes()
    given = None
    if req.plan is not None:  # the caller's explicit plan: its tiles, its tile shape
        bm, bn = req.plan.block
        given = req.plan.collapsed()
        if req.plan_extra is not None:  # causal=True on top of the plan: closed form, intersected
            given = torch.minimum(given, _worklist.tile_map(req.plan_extra, B, H, L, S, bm, bn))
    c = TileContext(req, worker)
    if worker == "native":  # the kernel finds its tiles from the row intervals: no work list to build
        why = None if "row_intervals" in req.memo or "tile_bits" in req.memo else native_unfit(req)
        if why is not None:
            raise RuntimeError(f"the compiled kernel cannot run this call: {why}")
        return _TiledAttention.apply(req.q, req.k, req.v, req.bias, c, *c.captured)
    c.plan_bm_bn, c.given = (bm, bn), given
    c.causal = _tiled_fused.causal_pieces(req, given) if worker == "fused" else None
    c.plan = _work_list(req, worker, (bm, bn), given)
    return _TiledAttention.apply(req.q, req.k, req.v, req.bias, c, *c.captured)


def context(req: Request, worker: str) -> TileContext:
    """The :class:`TileContext` :func:`_launch` builds for ``worker`` (its tiles, work list, gradient targets),
    without running anything: for callers that run ``_TiledAttention``'s forward and backward themselves
    (``attnkit._op``, the torch op behind ``torch.compile``). For ``"native"`` the mask's row intervals or
    tile map must be in ``req.memo`` (:func:`choose_worker` / :func:`native_unfit` leave them there)."""
    B, H, L, S, *_ = req.shape
    bm, bn, _ = _sizes()
    given = None
    if req.plan is not None:
        bm, bn = req.plan.block
        given = req.plan.collapsed()
        if req.plan_extra is not None:
            given = torch.minimum(given, _worklist.tile_map(req.plan_extra, B, H, L, S, bm, bn))
    c = TileContext(req, worker)
    if worker == "native":
        why = None if "row_intervals" in req.memo or "tile_bits" in req.memo else native_unfit(req)
        if why is not None:
            raise RuntimeError(f"the compiled kernel cannot run this call: {why}")
        return c
    c.plan_bm_bn, c.given = (bm, bn), given
    c.causal = _tiled_fused.causal_pieces(req, given) if worker == "fused" else None
    c.plan = _work_list(req, worker, (bm, bn), given)
    return c


def _work_list(req: Request, worker: str, block, given):
    """The work list for ``worker``: the fused kernel tiles internally (uncapped runs, identical
    query blocks merged); the plain loop keeps each score tile at most bm × MAX_RUN per group."""
    B, H, L, S, *_ = req.shape
    bm, bn = block
    if worker == "fused":
        additive = req.score_mod is not None and additive_mod(req.score_mod)
        return _worklist.work_list(req.mask, req.dense_mask, B, H, L, S, bm, bn, max(S, bn),
                                   max_group_elems=FUSED_MASK_ELEMS, count_all=req.bias is not None or additive,
                                   memo=req.memo, given=given)
    _, _, max_run = _sizes()
    return _worklist.work_list(req.mask, req.dense_mask, B, H, L, S, bm, bn, max(max_run, bn),
                               max_group_elems=bm * max_run, memo=req.memo, given=given)


def run(req: Request, worker: str | None = None):
    """The backend entry point; ``worker`` as decided by :func:`choose_worker` (asked here if None)."""
    if worker is None:
        worker, _ = choose_worker(req)
    return _launch(req, worker)
