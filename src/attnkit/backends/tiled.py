"""``backend="tiled"``: FlashAttention's algorithm (Dao et al. 2022; FA2, Dao 2023) over PyTorch ops.

Exact attention, forward and backward, in O(L + S) extra memory, skipping the
tiles a mask empties. Layers (as in flash_attn_triton.py):

    _tiled_fused           the loops over query blocks and key runs (the "kernel"); per run
                           one call of torch's private CPU flash kernel (_flash_cpu), merged
                           by log-sum-exp (_softmax.merge)
    _tiled_plain           the same loops in plain torch ops (_softmax.online_step): any
                           score_mod, gradients into captured tensors and float masks, any device
    FLASH_RUNS, PLAIN      the two as declared kernels (backends._kernel); which runs a call is the
                           device's table (backends._table), reported by attnkit.dispatch
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

import torch

from . import _flash_cpu, _softmax, _tiled_fused, _tiled_plain, _tiles, _worklist, eager
from ._base import Request
from ._kernel import Kernel
from ._tiled_ctx import TileContext, additive_mod
from ._tiles import has_nonfinite

__all__ = ["NAME", "FLASH_RUNS", "PLAIN", "auto_reason", "unsupported", "partial_fraction", "run", "block_sizes",
           "context"]

NAME = "tiled"

BLOCK_M = 64
BLOCK_N = 64
# Keys per GEMM in the plain worker: large enough to amortise Python per step, small
# enough that a score tile of (B·H·bm × MAX_RUN) stays cache-friendly.
MAX_RUN = 1024
# False sends every request to the plain worker (tests run every worker).
FUSED = True
# False keeps requests off attnkit's compiled kernel (backends.native; tests compare the workers).
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


def auto_reason(req: Request, passed) -> str:
    """``Decision.reason`` when ``auto`` chose one of the tiled engine's kernels: what SDPA (or, on a GPU,
    FlexAttention) could not do or declined, from the table's verdicts ``passed``."""
    for k, reasons, _ in passed:
        if k.backend == "flex":
            return f"FlexAttention cannot honour this ({'; '.join(reasons)}): the tiled plain worker runs on any device"
    for k, reasons, declined in passed:
        if k.backend != "sdpa":
            continue
        if declined:
            r = reasons[0]
            return r if "compiled kernel is faster" in r else f"block-sparse tiled kernel for {r}"
        if req.score_mod is not None:
            return "block-sparse tiled kernel for a score_mod"
        flaw = k.backward_flaw(req)  # the SDPA kernel's own judgement of its autograd (no import of sdpa here)
        if flaw is not None and flaw in reasons:
            return f"tiled kernel, exact gradients where SDPA's are not: {flaw}"
        return "torch SDPA cannot return what was asked"
    return "the tiled engine"


class _Tiled(Kernel):
    """The tiled engine's kernels share auto's reason (what SDPA could not do or declined)."""

    def auto_reason(self, req: Request, passed) -> str:
        return auto_reason(req, passed)


class FlashRuns(_Tiled):
    """torch's private CPU flash kernel per run of keys (the ``fused`` worker), merged by log-sum-exp."""

    name = "flash-runs"
    backend = "tiled"
    worker = "fused"
    title = "torch's flash kernel per run"
    devices = ("cpu",)
    measured = ("benchmarks/kernel.py ('before' column): the path of every structured mask before the compiled "
                "kernel; 1.2-3x slower than it, kept where the kernel cannot run")

    def not_supported(self, req: Request) -> list[str]:
        why = [] if FUSED else ["the fused worker is switched off (tiled.FUSED = False)"]
        if req.dropout_p > 0:
            why.append("the tiled backend has no dropout (use backend='eager')")
        if req.score_mod is not None and not additive_mod(req.score_mod):
            why.append("a score_mod that is not an additive bias (the fused kernel takes only a bias tile)")
        if req.q.shape[-1] != req.v.shape[-1]:
            why.append("D != Dv (the fused kernel needs equal head dims)")
        if req.device_type != "cpu":
            why.append(f"tensors on {req.device_type} (the fused kernel is CPU-only)")
        if req.extra_grads():
            why.append("gradients into a float mask or score_mod tensors (differentiated tile by tile)")
        if not _flash_cpu.available():
            why.append(f"torch's private CPU flash kernel is unavailable ({_flash_cpu.unavailable_reason()})")
        if not why and has_nonfinite(req.q, req.k, req.v):
            # the kernel may output 0 on a row whose scores hold NaN or inf; the plain worker propagates NaN
            why.append("NaN or inf in q, k or v (the fused kernel could hide a NaN)")
        return why

    def why(self, req: Request) -> str:
        if _tiled_fused.causal_pieces(req, req.plan) is not None:
            return ("torch's CPU flash kernel with its own causal block skipping (causal alone: one call per "
                    "query-head group and key range, merged by log-sum-exp)")
        return "torch's CPU flash kernel per run of keys, merged by log-sum-exp"

    def run(self, req: Request):
        return _launch(req, "fused")


class Plain(_Tiled):
    """The same loops in plain torch ops (the ``plain`` worker): any score_mod, gradients into captured
    tensors and float masks, any device."""

    name = "plain"
    backend = "tiled"
    worker = "plain"
    title = "the plain-op tile loop"
    measured = "benchmarks/kernel.py: the slowest tiled path (torch ops per tile); it runs what no kernel above can"

    def not_supported(self, req: Request) -> list[str]:
        why = unsupported(req)
        return [] if why is None else [why]

    def why(self, req: Request) -> str:
        return "plain torch ops per tile (any score_mod, gradients into captured tensors, any device)"

    def run(self, req: Request):
        return _launch(req, "plain")


FLASH_RUNS = FlashRuns()
PLAIN = Plain()


# Above this fraction of partial tiles a user bool mask stays with SDPA (tiled ≈ 0.96× there: nothing to skip).
DENSE_PARTIAL_MAX = 0.9
# A user bool mask of one tile (L, S <= 64): nothing a tile analysis could skip; without gradients the compiled
# kernel reads its bits in one C pass per call (sdpa._small_mask_to_kernel), else SDPA applies it as it is.
SMALL_MASK = 64


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
        if torch.is_grad_enabled():  # create_graph: the gradients must be a graph (a double backward reads them)
            gq, gk, gv, gb, gcap = eager.graph_backward(c.req, q, k, v, c.req.bias, list(c.captured), dout, dlse)
            return (gq, gk, gv, gb, None, *gcap)
        if dout is None:
            dout = torch.zeros_like(out)
        dbias, dcap = None, [None] * len(c.captured)
        # Rows where exp(s - lse) is not exact (scores all at finfo.min / -1e9: issue 18) leave
        # the workers (torch's kernel has the flaw inside): their dout and dlse are zeroed, so the
        # workers' share there is exactly 0, and exact_rows_backward adds theirs. O(L) to find.
        dout_all, dlse_all = dout, dlse
        rows, dout, dlse = _softmax.split_inexact(lse, dout, dlse)
        fix = rows is not None
        if c.fused and dlse is None:
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


def _add(a, b):
    """a + b where either may be None (a gradient nobody produced)."""
    return b if a is None else a if b is None else a + b.to(a.dtype)


def _launch(req: Request, worker: str):
    c = context(req, worker)
    return _TiledAttention.apply(req.q, req.k, req.v, req.bias, c, *c.captured)


def context(req: Request, worker: str) -> TileContext:
    """The :class:`TileContext` :func:`_launch` builds for ``worker`` (``"fused"`` or ``"plain"``: its tiles, work
    list, gradient targets), without running anything: for callers that run ``_TiledAttention``'s forward and
    backward themselves (``attnkit._op``, the torch op behind ``torch.compile``)."""
    B, H, L, S, *_ = req.shape
    bm, bn, _ = _sizes()
    given = None
    if req.plan is not None:
        bm, bn = req.plan.block
        given = req.plan.collapsed()
        if req.plan_extra is not None:
            given = torch.minimum(given, _worklist.tile_map(req.plan_extra, B, H, L, S, bm, bn))
    c = TileContext(req, worker)
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


def run(req: Request, worker: str):
    """The fused (``"fused"``) or plain (``"plain"``) worker on ``req``; the compiled kernel is
    :mod:`.native`'s, and which runs is the table's choice (:mod:`attnkit.backends._table`)."""
    return _launch(req, worker)
