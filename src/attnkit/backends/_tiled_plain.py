"""The tiled backend's plain worker: FlashAttention's loops in plain torch ops.

Runs anything the request can hold — any score_mod (differentiated tile by tile,
with respect to the score and every tensor it captures), float masks that require
grad, NaN inputs (propagated to exactly the rows they touch), any device. q, k, v
are upcast once to the compute dtype (fp32 for bf16/fp16: O(L + S) memory).

Forward, per group of query rows and per run of keys (``_softmax.online_step``)::

    s = (q·scale) kᵀ → score_mod → + bias → -inf where masked      (B, Hkv, g·l, n)
    m_i, l_i, acc ← online_step(m_i, l_i, acc, s, v_run)

Backward (FA2): ``delta = rowsum(dO ∘ O) - dlse``; per tile ``p = exp(s - lse)``,
``dv += pᵀ dO``, ``ds = p ∘ (dO vᵀ - delta)``; ``d bias = ds`` (summed over its
broadcast dims); through the score_mod ``ds ← ∂mod/∂s · ds`` (analytic for attnkit's
own mods, ``torch.autograd.grad`` otherwise, which also yields the captured tensors'
gradients); ``dq += ds k·scale``, ``dk += dsᵀ q·scale``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from .. import score_mods as _score_mods
from . import _softmax
from ._tiled_ctx import TileContext
from ._tiles import allowed_tile, apply_score_mod, index_grid, tile_of

__all__ = ["prepare", "forward", "backward"]


def prepare(c: TileContext, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upcast (bf16/fp16 → fp32, once) and fold the scale into q."""
    return (q.to(c.cd) * c.req.scale).contiguous(), k.to(c.cd), v.to(c.cd)


def _scores(c: TileContext, qb, k, i0, i1, j0, j1, spans, track=False, hidden=None):
    """Scaled, modified and masked scores of one run ``(B, Hkv, g·l, n)``.

    With ``track`` also returns what the backward needs to go through the score_mod:
    ``("dscore", ∂mod/∂s)`` or ``(s_raw, s_mod)`` with an autograd graph. ``hidden``: a ``(B, H, l, n)``
    bool tensor (False) that gets the points the mask hides (for a V holding NaN or inf: not read there).
    """
    req = c.req
    l, n = i1 - i0, j1 - j0
    s = torch.matmul(qb, k[:, :, j0:j1].transpose(-1, -2))  # (B, Hkv, g·l, n); scale folded into q
    s4 = s.view(c.B, c.H, l, n)
    graph: tuple | None = None
    if req.score_mod is not None:
        b, h, qi, kj = index_grid(c.B, c.H, i0, l, j0, n, s.device)
        fn = req.score_mod
        analytic = not c.captured and isinstance(fn, _score_mods.ScoreMod) and fn.analytic_grad
        if track and not analytic:
            # differentiate the tile: with respect to the score and every captured tensor
            with torch.enable_grad():
                s_raw = s4.detach().requires_grad_(True)
                s_mod = apply_score_mod(req, s_raw, b, h, qi, kj)
            graph = (s_raw, s_mod)
            s4 = s_mod.detach()
        else:
            s4 = apply_score_mod(req, s4, b, h, qi, kj)
        s4 = s4.to(c.cd).expand(c.B, c.H, l, n).contiguous()
        if track and analytic and isinstance(fn, _score_mods.ScoreMod) and not fn.additive:
            graph = ("dscore", fn.dscore(s4))
    if req.bias is not None:
        s4 = s4 + tile_of(req.bias, i0, l, j0, n).to(c.cd)
    for a, b_ in spans:
        allowed = allowed_tile(req, i0, l, a, b_ - a)
        if allowed is not None:  # a span is partial only under a mask, so this is the rule
            s4[..., a - j0:b_ - j0].masked_fill_(~allowed, float("-inf"))
            if hidden is not None:
                hidden[..., a - j0:b_ - j0] = ~allowed
    return s4.reshape(c.B, c.Hkv, c.g * l, n), graph


def _nonfinite_keys(v: torch.Tensor) -> list[int]:
    """The keys (sorted) whose value holds NaN or inf in some batch row or kv head: read once a call."""
    fin = torch.isfinite(v)
    return [] if bool(fin.all()) else _softmax.nonfinite_keys(fin).tolist()


def _hidden(c: TileContext, bad_keys: list[int], j0: int, j1: int, l: int, spans) -> torch.Tensor | None:
    """A ``(B, H, l, j1 - j0)`` bool tensor (False) for :func:`_scores` to fill with the points the mask hides,
    where the run has partial spans and a key of it holds NaN / inf (``bad_keys``: :func:`_nonfinite_keys`); else
    None (nothing the matmul could read wrongly)."""
    if not spans or bisect.bisect_left(bad_keys, j0) == bisect.bisect_left(bad_keys, j1):
        return None
    return torch.zeros(c.B, c.H, l, j1 - j0, dtype=torch.bool, device=c.req.q.device)


def forward(c: TileContext, qs, k, v):
    """out (B, H, L, Dv) and lse (B, H, L) in the compute dtype; query rows with no run keep 0 / -inf."""
    B, Hkv, g, L, Dv = c.B, c.Hkv, c.g, c.L, c.Dv
    qs5 = qs.view(B, Hkv, g, L, qs.shape[-1])
    out = torch.zeros(B, Hkv, g, L, Dv, dtype=c.cd, device=qs.device)
    lse = torch.full((B, Hkv, g, L), float("-inf"), dtype=c.cd, device=qs.device)
    bad_keys = _nonfinite_keys(v)  # NaN / inf in V: a value the mask hides is not read there
    assert c.plan is not None  # set by the launcher
    for i0, i1, runs in c.plan.groups:
        l = i1 - i0
        qb = c.q_block(qs5, i0, i1)
        m_i = l_i = acc = None
        for j0, j1, spans in runs:
            hid = _hidden(c, bad_keys, j0, j1, l, spans)
            s, _ = _scores(c, qb, k, i0, i1, j0, j1, spans, hidden=hid)
            m_i, l_i, acc = _softmax.online_step(m_i, l_i, acc, s, v[:, :, j0:j1],
                                                 None if hid is None else hid.view(B, Hkv, g * l, -1))
        o_b, lse_b = _softmax.online_finish(m_i, l_i, acc)
        out[:, :, :, i0:i1] = o_b.view(B, Hkv, g, l, Dv)
        lse[:, :, :, i0:i1] = lse_b.view(B, Hkv, g, l)
    return out.view(B, c.H, L, Dv), lse.view(B, c.H, L)


def backward(c: TileContext, qs, k, v, out, lse, dout, dlse):
    """dq, dk, dv, d bias (or None), [d captured] by recomputing each tile; O(L + S) extra memory."""
    B, Hkv, g, L, D, Dv = c.B, c.Hkv, c.g, c.L, c.D, c.Dv
    scale = c.req.scale
    qs5 = qs.view(B, Hkv, g, L, D)
    do = dout.to(c.cd)
    do5 = do.reshape(B, Hkv, g, L, Dv)
    delta = (do * out.to(c.cd)).sum(dim=-1)  # (B, H, L): rowsum(dO ∘ O)
    if dlse is not None:
        delta = delta - dlse.to(c.cd)  # d lse / d s = p, folded into the same term
    delta5 = delta.view(B, Hkv, g, L)
    lse5 = _softmax.lse_for_backward(lse.to(c.cd)).view(B, Hkv, g, L)
    bad_keys = _nonfinite_keys(v)
    dq = torch.zeros(B, Hkv, g, L, D, dtype=c.cd, device=qs.device)
    dk = torch.zeros(B, Hkv, c.S, D, dtype=c.cd, device=qs.device)
    dv = torch.zeros(B, Hkv, c.S, Dv, dtype=c.cd, device=qs.device)
    bias = c.req.bias
    dbias = torch.zeros(bias.shape, dtype=c.cd, device=bias.device) if bias is not None and c.bias_grad else None
    dcap: list[torch.Tensor | None] = [None] * len(c.captured)
    assert c.plan is not None  # set by the launcher
    for i0, i1, runs in c.plan.groups:
        l = i1 - i0
        qb = c.q_block(qs5, i0, i1)  # (B, Hkv, g·l, D), already scaled
        dob = c.q_block(do5, i0, i1)
        lse_b = lse5[:, :, :, i0:i1].reshape(B, Hkv, g * l, 1)
        delta_b = delta5[:, :, :, i0:i1].reshape(B, Hkv, g * l, 1)
        dqb = None
        for j0, j1, spans in runs:
            n = j1 - j0
            hid = _hidden(c, bad_keys, j0, j1, l, spans)
            s, graph = _scores(c, qb, k, i0, i1, j0, j1, spans, track=True, hidden=hid)
            p = s.sub_(lse_b).exp_()  # (B, Hkv, g·l, n) exact weights
            dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2), dob)  # sums the g heads too
            dp = torch.matmul(dob, v[:, :, j0:j1].transpose(-1, -2))
            if hid is not None:  # a NaN / inf value the mask hides reaches no gradient (not 0 · NaN)
                dp.masked_fill_(hid.view(B, Hkv, g * l, n), 0.0)
            ds = p.mul_(dp.sub_(delta_b))  # p ∘ (dp - delta): gradient of the modified score
            if dbias is not None:  # d bias = ds, summed over the dims the bias broadcasts
                _accumulate_broadcast(dbias, ds.view(B, c.H, l, n), i0, l, j0, n)
            if graph is not None:
                if graph[0] == "dscore":
                    ds = ds.mul_(graph[1].view_as(ds))
                else:
                    s_raw, s_mod = graph
                    if s_mod.requires_grad:
                        grads: Sequence[torch.Tensor | None] = torch.autograd.grad(s_mod, [s_raw, *c.captured],
                                                    ds.view(B, c.H, l, n).expand_as(s_mod).to(s_mod.dtype),
                                                    allow_unused=True)
                    else:  # an integer-valued mod (cast to float): no path from the score or a tensor
                        grads = [None] * (1 + len(c.captured))
                    for t, gt in enumerate(grads[1:]):
                        if gt is not None:
                            prev = dcap[t]
                            dcap[t] = gt if prev is None else prev + gt
                    grad = grads[0]
                    ds = torch.zeros_like(ds) if grad is None else grad.reshape(B, Hkv, g * l, n).to(c.cd)
            dqb_run = torch.matmul(ds, k[:, :, j0:j1])
            dqb = dqb_run if dqb is None else dqb.add_(dqb_run)
            dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qb)  # qb carries the scale
        assert dqb is not None  # a group has at least one run
        dq[:, :, :, i0:i1] = (dqb * scale).view(B, Hkv, g, l, D)
    return dq.view(B, c.H, L, D), dk, dv, dbias, dcap


def _accumulate_broadcast(dst: torch.Tensor, g: torch.Tensor, i0: int, l: int, j0: int, n: int) -> None:
    """dst[..., rows, cols] += g (B, H, l, n) summed over the dims where dst has size 1."""
    dims = [d for d in range(4) if dst.shape[d] == 1 and g.shape[d] != 1]
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    tile_of(dst, i0, l, j0, n).add_(g.to(dst.dtype))
