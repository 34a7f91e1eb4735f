"""The W-rank simulation in one process: the same layout, schedule, pair math and merge order as
:class:`~attnkit.distributed.ContextParallel` — the oracle every transport is tested against."""

from __future__ import annotations

import torch

from .layouts import Layout
from .layouts import layout as _layout
from .pairs import _acc_dtype, _captured, _options, _owner_order, _rank_backward, _rank_forward
from .schedules import _plan_B, _plan_H, schedule


class _SimFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lay, sched, opts, q, k, v, *captured):
        ctx.set_materialize_grads(False)
        W, P = lay.W, lay.positions
        outs, lses, saved = [], [], []
        for r in range(W):
            qr = q.index_select(2, P[r])
            kv = {s: (k.index_select(2, P[s]), v.index_select(2, P[s])) for s in range(W) if sched.visible[r, s]}
            o, c, rr = _rank_forward(qr, kv, r, P[r], P, sched.row_blocks(r), opts, Dv=v.shape[-1])
            outs.append(o)
            lses.append((c, rr))
            saved.append((qr, kv))
        out = torch.cat(outs, 2).index_select(2, lay.inverse)
        lse = torch.cat([c + rr for c, rr in lses], 2).index_select(2, lay.inverse)
        ctx.lay, ctx.sched, ctx.opts, ctx.saved, ctx.outs, ctx.lses = lay, sched, opts, saved, outs, lses
        ctx.shapes = (q, k, v)
        ctx.captured = captured
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        lay, sched, opts = ctx.lay, ctx.sched, ctx.opts
        q, k, v = ctx.shapes
        W, P = lay.W, lay.positions
        acc = _acc_dtype(q.dtype)
        dqs = []
        parts_by_owner: list[dict] = [{} for _ in range(W)]
        capg: list[torch.Tensor | None] = [None] * len(ctx.captured)
        for r in range(W):
            qr, kv = ctx.saved[r]
            dq, parts, cap = _rank_backward(qr, kv, r, P[r], P, sched.row_blocks(r), opts, ctx.outs[r], ctx.lses[r],
                                            None if dout is None else dout.index_select(2, P[r]),
                                            None if dlse is None else dlse.index_select(2, P[r]),
                                            list(ctx.captured))
            dqs.append(dq)
            for s, pr in parts.items():
                parts_by_owner[s][r] = pr
            for i, g in enumerate(cap):
                if g is not None:
                    capg[i] = g if capg[i] is None else capg[i] + g
        dks, dvs = [], []
        for s in range(W):
            dk, dv = _sum_parts(parts_by_owner[s], k.index_select(2, P[s]), v.index_select(2, P[s]), acc, s, W)
            dks.append(dk)
            dvs.append(dv)
        def cat(xs, like):
            return torch.cat(xs, 2).index_select(2, lay.inverse).to(like.dtype)

        return (None, None, None, cat(dqs, q), cat(dks, k), cat(dvs, v), *capg)


def _sum_parts(parts: dict, k_own, v_own, acc, owner: int, W: int):
    """The owner's dK, dV: its partials summed in the order they stream back (:func:`_owner_order`)."""
    dk = torch.zeros(k_own.shape, dtype=acc, device=k_own.device)
    dv = torch.zeros(v_own.shape, dtype=acc, device=v_own.device)
    for t in (t for t in _owner_order(owner, W) if t in parts):
        dk += parts[t][0]
        dv += parts[t][1]
    return dk, dv


def simulate(q, k, v, *, W: int, layout="contiguous", mask=None, causal=False, scale=None, score_mod=None,
             return_lse=False, block=None):
    """Context-parallel attention over ``W`` *virtual* ranks in one process: the same layout,
    schedule, pair math and merge order as :class:`ContextParallel`, on full tensors
    ``q (B, H, L, D)`` etc.; returns the full result in global order (autograd works).
    ``layout`` is a name or a :class:`Layout`."""
    L = q.shape[2]
    if k.shape[2] != L:
        raise ValueError(f"k: context parallelism is self-attention (S = L = {L}), got S={k.shape[2]}.")
    base, opts = _options(L, mask, causal, scale, score_mod)
    if score_mod is not None and hasattr(score_mod, "validate"):
        score_mod.validate(q.shape[0], q.shape[1], L, L)
    lay = layout if isinstance(layout, Layout) else _layout(
        layout, L, W, mask=base, block=block, B=_plan_B(base, q.shape[0]), H=None)
    sched = schedule(lay, base, B=_plan_B(base, q.shape[0]), H=_plan_H(base, q.shape[1]))
    out, lse = _SimFn.apply(lay, sched, opts, q, k, v, *_captured(score_mod))
    return (out, lse) if return_lse else out
