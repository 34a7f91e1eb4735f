"""The score pipeline on one tile, shared by the torch backends: index grids, score_mod,
bias and mask application, and exact weights recomputed from lse.

A "tile" is the block of scores for query rows ``[i0, i0 + l)`` and key columns
``[j0, j0 + s)``; the dense backends use one tile covering everything.
"""

from __future__ import annotations

import torch

from .. import _mods
from .. import score_mods as _score_mods
from . import _softmax
from ._base import Request
from ._flash_cpu import has_nonfinite

__all__ = ["has_nonfinite", "index_grid", "tile_of", "apply_score_mod", "modify_scores", "allowed_tile",
           "weights_from_lse", "exact_rows_backward"]

# Largest (B·H·rows × S) score block exact_rows_backward holds at once.
ROWS_ELEMS = 1 << 22

NEG_INF = float("-inf")


def tile_of(t: torch.Tensor, i0: int, l: int, j0: int, s: int) -> torch.Tensor:
    """Rows ``[i0, i0 + l)`` and columns ``[j0, j0 + s)`` of a 4-D tensor broadcastable to
    ``(B, H, L, S)``; a size-1 (broadcast) row or column dim is kept whole, never sliced empty."""
    rows = slice(i0, i0 + l) if t.shape[-2] != 1 else slice(None)
    cols = slice(j0, j0 + s) if t.shape[-1] != 1 else slice(None)
    return t[..., rows, cols]


def _tensor_tile(t: torch.Tensor, i0: int, l: int, j0: int, s: int, heads=None, batch=None) -> torch.Tensor:
    """The tile of a user mask tensor (bool or bias), restricted to the selected heads / batch rows
    where it has those dims (a size-1 dim broadcasts and is kept)."""
    t = tile_of(t, i0, l, j0, s)
    if heads is not None and t.shape[1] != 1:
        t = t[:, heads]
    if batch is not None and t.shape[0] != 1:
        t = t[batch]
    return t


def apply_score_mod(req: Request, s: torch.Tensor, b, h, q, kv) -> torch.Tensor:
    """``req.score_mod`` on a tile of scaled scores ``s`` with broadcasting indices.

    attnkit's own :class:`~attnkit.score_mods.ScoreMod` objects are broadcast-safe; any other
    function goes through :func:`attnkit._mods.eval_score_mod` (vmap where broadcasting
    would differ from FlexAttention's per-scalar semantics)."""
    fn = req.score_mod
    if isinstance(fn, _score_mods.ScoreMod):
        out = fn(s, b, h, q, kv)
    else:
        B, H, L, S, *_ = req.shape
        out = _mods.eval_score_mod(fn, s, b, h, q, kv, (b.numel(), h.numel(), L, S))
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"score_mod: expected it to return a tensor of scores, got {type(out).__name__}. "
            "Return a tensor, e.g. score + bias[h] (FlexAttention's score_mod signature).")
    if out.dtype.is_complex:
        raise TypeError(f"score_mod: expected real scores, got a tensor of dtype {out.dtype}. "
                        "Return out.real or a float tensor.")
    if not out.is_floating_point():
        # An integer (or bool) score, e.g. ``kv_idx - q_idx``: FlexAttention's own math promotes it
        # to the working precision (torch.where against its float -inf), so do the same, on every
        # backend. It does not depend on the score differentiably: d(mod)/d(score) is 0.
        out = out.to(s.dtype if s.is_floating_point() else torch.float32)
    if out.shape != s.shape:  # a mod of the indices alone (kv_idx - q_idx) broadcasts to the tile
        out = out.expand(torch.broadcast_shapes(out.shape, s.shape))
    return out


def index_grid(B: int, H: int, i0: int, l: int, j0: int, s: int, device, heads=None):
    """Broadcastable index tensors ``b (B,1,1,1)``, ``h (1,H,1,1)``, ``q (1,1,l,1)``, ``kv (1,1,1,s)``.

    ``heads`` optionally lists the absolute head indices of the H heads present.
    """
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = (torch.arange(H, device=device) if heads is None else torch.as_tensor(heads, device=device)).view(1, -1, 1, 1)
    q = torch.arange(i0, i0 + l, device=device).view(1, 1, l, 1)
    kv = torch.arange(j0, j0 + s, device=device).view(1, 1, 1, s)
    return b, h, q, kv


def allowed_tile(req: Request, i0: int, l: int, j0: int, s: int, heads=None, batch=None) -> torch.Tensor | None:
    """Bool tile (broadcastable to ``(B, H, l, s)``) of where attention is allowed, or None (all)."""
    B, H, L, S, *_ = req.shape
    allowed = None
    if req.mask is not None:
        b, h, q, kv = index_grid(B, H, i0, l, j0, s, req.q.device, heads)
        if batch is not None:
            b = b[batch]
        allowed = req.mask.bind(L, S)(b, h, q, kv)
    if req.dense_mask is not None:
        dm = _tensor_tile(req.dense_mask, i0, l, j0, s, heads, batch)
        allowed = dm if allowed is None else allowed & dm
    return allowed


def modify_scores(req: Request, s_tile: torch.Tensor, i0: int, j0: int, heads=None, batch=None) -> torch.Tensor:
    """Apply score_mod, the float bias and the masks to a tile of *scaled* scores ``(B, H, l, s)``."""
    B, H, L, S, *_ = req.shape
    l, s = s_tile.shape[-2], s_tile.shape[-1]
    if req.score_mod is not None:
        b, h, q, kv = index_grid(B, H, i0, l, j0, s, s_tile.device, heads)
        if batch is not None:
            b = b[batch]
        s_tile = apply_score_mod(req, s_tile, b, h, q, kv)
    if req.bias is not None:
        s_tile = s_tile + _tensor_tile(req.bias, i0, l, j0, s, heads, batch).to(s_tile.dtype)
    allowed = allowed_tile(req, i0, l, j0, s, heads, batch)
    if allowed is not None:
        s_tile = s_tile.masked_fill(~allowed, NEG_INF)
    return s_tile


def weights_from_lse(req: Request, lse: torch.Tensor, heads=None) -> torch.Tensor:
    """Exact attention weights ``exp(s - lse)`` ``(B, H', L, S)`` recomputed from q, k and lse.

    Used to return weights from a fast path without holding them during the forward:
    only the requested ``heads`` (absolute indices) are recomputed.
    """
    B, H, L, S, D, Dv, Hkv = req.shape
    heads = list(range(H)) if heads is None else [int(h) for h in heads]
    g = H // Hkv
    cd = req.compute_dtype()
    q = req.q[:, heads].to(cd)
    k = req.k[:, [h // g for h in heads]].to(cd)
    s = torch.matmul(q, k.transpose(-1, -2)) * req.scale
    s = modify_scores(req, s, 0, 0, heads=heads)
    return _softmax.weights_from_lse(s, lse[:, heads].to(cd))


def exact_rows_backward(req: Request, rows: torch.Tensor, dout: torch.Tensor, dlse, extra: list):
    """Gradients of the query rows ``rows`` (bool ``(L,)``, every batch row and head) on their own.

    For rows where the kernels' ``p = exp(s - lse)`` is not exact (``_softmax.inexact_rows``:
    scores all at ``finfo.min`` / -1e9): the rows' dense scores are rebuilt (score_mod, bias,
    masks, as the forward), their softmax taken from their own ``(m_i, l_i)``
    (``_softmax.softmax_lse``) and differentiated by autograd against ``dout`` (and ``dlse``).
    Callers zero ``dout``/``dlse`` on these rows for their kernel, whose contribution there is
    then exactly 0, and add these. Cost O(rows · S · D), in blocks of at most ``ROWS_ELEMS``
    scores. Returns ``dq, dk, dv`` (compute dtype) and the gradients of ``extra`` (the float
    mask and captured tensors requiring grad; None where unused)::

        rows = [F, T, T, F]     q1, q2 here;  q0, q3 by the kernel (with dout zeroed on q1, q2)
    """
    B, H, L, S, D, Dv, Hkv = req.shape
    g = H // Hkv
    cd = req.compute_dtype()
    idx = torch.nonzero(rows).flatten().tolist()
    step = max(1, ROWS_ELEMS // (B * H * S))
    pieces, i = [], 0
    while i < len(idx):  # contiguous segments of rows, at most `step` rows each
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1 and j + 1 - i < step:
            j += 1
        pieces.append((idx[i], idx[j] + 1))
        i = j + 1
    dq = torch.zeros(req.q.shape, dtype=cd, device=req.q.device)
    dk = torch.zeros(req.k.shape, dtype=cd, device=req.q.device)
    dv = torch.zeros(req.v.shape, dtype=cd, device=req.q.device)
    dext: list[torch.Tensor | None] = [None] * len(extra)
    kd, vd = (t.detach().to(cd).requires_grad_() for t in (req.k, req.v))
    for i0, i1 in pieces:
        l = i1 - i0
        with torch.enable_grad():
            qd = req.q[:, :, i0:i1].detach().to(cd).requires_grad_()
            s = torch.matmul(qd.reshape(B, Hkv, g, l, D), kd.unsqueeze(2).transpose(-1, -2)) * req.scale
            s = modify_scores(req, s.reshape(B, H, l, S), i0, 0)  # (B, H, l, S), as the forward built them
            p, lse = _softmax.softmax_lse(s)  # from the row's own m_i, l_i: exact on any finite row
            o = torch.matmul(p.reshape(B, Hkv, g, l, S), vd.unsqueeze(2)).reshape(B, H, l, Dv)
            loss = (o * dout[:, :, i0:i1].to(cd)).sum()
            if dlse is not None:
                loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse[:, :, i0:i1].to(cd)).sum()
            grads = torch.autograd.grad(loss, [qd, kd, vd, *extra], allow_unused=True)
        for acc, gr in ((dq[:, :, i0:i1], grads[0]), (dk, grads[1]), (dv, grads[2])):
            if gr is not None:  # None: the scores do not depend on it (an integer-valued score_mod)
                acc += gr
        for t, gr in enumerate(grads[3:]):
            if gr is not None:
                prev = dext[t]
                dext[t] = gr if prev is None else prev + gr
    return dq, dk, dv, dext
