"""``backend="tiled"``: FlashAttention's algorithm (Dao et al. 2022; FA2, Dao 2023) over PyTorch ops.

Exact attention, forward and backward, in O(L + S) extra memory, skipping the
tiles a mask empties. Layers (as in flash_attn_triton.py):

    _forward_fused /       the loops over query blocks and key runs (the "kernel"); per run
    _backward_fused        one call of torch's fused CPU flash kernel, merged by log-sum-exp
    _forward / _backward   the same loops in plain torch ops (any score_mod, any device)
    _launch                block plan, choice of worker
    _TiledAttention        torch.autograd.Function: saves (q, k, v, out, lse) only
    run(req)               the backend entry point

Tiling, per query block of ``bm`` rows (GQA: the ``g = H // Hkv`` query heads
sharing a kv head are stacked into the GEMM's M dimension, so K/V are never
copied)::

               keys ─────────────────────────────►
             ┌──────┬──────┬──────┬──────┬──────┐
    q block  │ skip │  P   │  F   │  F   │  P   │   P partial: mask_mod on that tile
    (bm rows)└──────┴──────┴──────┴──────┴──────┘   F full: no mask evaluated
                    └──── one run: one GEMM ────┘   skip: empty tile, never computed

Online softmax over the runs of a query block (paper's names)::

    s      = (q·scale) kᵀ  → score_mod → + bias → -inf where masked
    m_new  = max(m_i, rowmax(s))
    p      = exp(s - m_new);  alpha = exp(m_i - m_new)
    l_i    = alpha·l_i + rowsum(p);   acc = alpha·acc + p v;   m_i = m_new
    out    = acc / l_i;   lse = m_i + log(l_i)

A row with no visible key keeps m_i = -inf, l_i = 0: the subtracted max is
clamped to the dtype's lowest finite value so exp gives 0 (never -inf - -inf =
NaN), and the output is 0 with lse -inf.

Backward (FA2): ``delta = rowsum(dO ∘ O)``; each tile is recomputed,
``p = exp(s - lse)``, ``dv += pᵀ dO``, ``ds = p ∘ (dO vᵀ - delta)``,
``dq += ds k·scale``, ``dk += dsᵀ q·scale``. A score_mod's derivative with respect
to the score is applied to ``ds`` on each tile: analytic for attnkit's own mods
(alibi and relative_bias add a constant: derivative 1; softcap: 1 - (s'/cap)²),
``torch.autograd.grad`` on the tile for any other. **Gradients reach every tensor
the call reads**: a float mask gets ``d bias = ds`` summed over its broadcast dims,
tile by tile; the tensors a score_mod captures (found by ``_request``: a ScoreMod's
own, or a closure's) are inputs of the autograd function, and each recomputed tile
is differentiated with respect to them too (``torch.autograd.grad(s_mod, [s, *captured])``).
A score_mod that reads a tensor requiring grad which attnkit cannot find is refused
(``auto`` sends it to eager, which differentiates through everything).

Two workers run the same plan. Without a score_mod (or with attnkit's additive
alibi / relative_bias, turned into a bias tile) each run is one call of torch's
fused CPU flash kernel ``_scaled_dot_product_flash_attention_for_cpu`` on
``(q block, k run, v run)`` with the run's partial tiles as an additive mask, and
the runs are merged with the log-sum-exp rule; its backward kernel given the
*global* out and lse gives the run's share of dq, dk, dv. This is what makes the
per-step work BLAS-sized and fused (a plain-op loop pays one memory pass per
elementwise op). Any other score_mod runs the plain-op loop written above.

Caveats vs the other backends: no dropout (``auto`` sends dropout to eager).
bf16/fp16: the fused worker keeps the GEMM inputs in bf16/fp16 with fp32 scores,
statistics and accumulators inside the kernel (as torch SDPA); a query block
with several runs gets each run's output rounded once to bf16/fp16 before the
fp32 log-sum-exp merge (one rounding per run; tests bound the total at 2× SDPA's
error). The plain-op loop upcasts q, k, v once to fp32 (O(L + S) memory).

Block sizes: ``BLOCK_M`` × ``BLOCK_N`` tiles; the plain-op loop caps runs at
``MAX_RUN`` keys (the fused kernel tiles internally, so its runs are uncapped);
override with ``ATTNKIT_TILED_BLOCKS="bm,bn[,max_run]"`` or the ``block_sizes``
context manager (tests sweep several).
"""

from __future__ import annotations

import contextlib
import os

import torch

from .. import masks as _masks
from .. import score_mods as _score_mods
from .._request import Request
from . import _blocks, _flash_cpu
from ._common import allowed_tile, apply_score_mod, has_nan, index_grid, tile_of

__all__ = ["NAME", "unsupported", "run", "block_sizes"]

NAME = "tiled"

BLOCK_M = 64
BLOCK_N = 64
# Keys per GEMM: large enough to amortise Python per step, small enough that a
# score tile of (B·H·bm × MAX_RUN) stays cache-friendly.
MAX_RUN = 1024
# Use torch's fused CPU flash kernel as the per-run worker where it applies (no
# score_mod other than attnkit's additive alibi/relative_bias, D == Dv, CPU); False
# runs every request through the plain-op loop (tests run both).
FUSED = True
# Largest (rows × keys) mask tile the fused worker builds for one group of query blocks.
FUSED_MASK_ELEMS = 1 << 22
# Largest per-call buffer (elements) of a batch of diagonal runs (see _schedule).
BATCH_ELEMS = 1 << 22


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


def _additive_mod(fn) -> bool:
    """attnkit's alibi / relative_bias: score + f(h, q, kv), so f can be a bias tile."""
    return isinstance(fn, _score_mods.ScoreMod) and fn.additive


def unsupported(req: Request) -> str | None:
    if req.dropout_p > 0:
        return "the tiled backend has no dropout (use backend='eager')"
    if req.grad_hidden:
        return ("the score_mod reads a tensor that requires grad where attnkit cannot find it (not in its "
                "closure, defaults or globals), so the tiled backward could not return its gradient "
                "(use backend='eager', or capture the tensor directly in the function)")
    return None


class _Ctx:
    """What the kernels need besides q, k, v: the request and its block plan."""

    def __init__(self, req: Request):
        self.req = req
        self.plan: _blocks.Plan | None = None
        self.schedule: list | None = None
        B, H, L, S, D, Dv, Hkv = req.shape
        self.B, self.H, self.L, self.S, self.D, self.Dv, self.Hkv = B, H, L, S, D, Dv, Hkv
        self.g = H // Hkv
        self.cd = req.compute_dtype()
        self.lowest = torch.finfo(self.cd).min
        # attnkit's alibi / relative_bias depend on (h, kv - q) only: shift-invariant additive biases
        self.additive = req.score_mod is not None and _additive_mod(req.score_mod)
        shift = ((req.mask is None or _shift_invariant(req.mask)) and req.dense_mask is None and req.bias is None)
        self.tile_cache: dict | None = {} if shift else None
        # Gradients wanted into a float mask or tensors the score_mod reads: the plain-op loop
        # differentiates each tile with respect to them (the fused kernel cannot).
        self.bias_grad = req.bias is not None and req.bias.requires_grad and torch.is_grad_enabled()
        self.captured = list(req.grad_tensors) if torch.is_grad_enabled() else []
        # The fused kernel returns 0 on a row whose scores hold NaN; the plain-op loop lets NaN
        # propagate to exactly the rows it touches (the API's promise), so NaN inputs take it.
        self.fused = (FUSED and (req.score_mod is None or self.additive) and D == Dv and req.q.device.type == "cpu"
                      and not self.bias_grad and not self.captured and _flash_cpu.available()
                      and not has_nan(req.q, req.k, req.v))

    def q_block(self, qs5, i0, i1):
        # (B, Hkv, g, l, D) -> (B, Hkv, g·l, D): the g heads sharing a kv head are one GEMM's rows
        return qs5[:, :, :, i0:i1].reshape(self.B, self.Hkv, self.g * (i1 - i0), qs5.shape[-1])

    def scores(self, qb, k, i0, i1, j0, j1, spans, track=False):
        """Scaled, modified and masked scores of one run ``(B, Hkv, g·l, n)``.

        With ``track`` returns also ``(s_raw, s_mod)`` for the score_mod's backward.
        """
        req = self.req
        l, n = i1 - i0, j1 - j0
        s = torch.matmul(qb, k[:, :, j0:j1].transpose(-1, -2))  # (B, Hkv, g·l, n); scale folded into q
        s4 = s.view(self.B, self.H, l, n)
        graph = None
        if req.score_mod is not None:
            b, h, qi, kj = index_grid(self.B, self.H, i0, l, j0, n, s.device)
            fn = req.score_mod
            analytic = not self.captured and isinstance(fn, _score_mods.ScoreMod) and fn.analytic_grad
            if track and not analytic:
                # differentiate the tile: with respect to the score and every captured tensor
                with torch.enable_grad():
                    s_raw = s4.detach().requires_grad_(True)
                    s_mod = apply_score_mod(req, s_raw, b, h, qi, kj)
                graph = (s_raw, s_mod)
                s4 = s_mod.detach()
            else:
                s4 = apply_score_mod(req, s4, b, h, qi, kj)
            s4 = s4.to(self.cd).expand(self.B, self.H, l, n).contiguous()
            if track and analytic and not fn.additive:
                graph = ("dscore", fn.dscore(s4))
        if req.bias is not None:
            s4 = s4 + tile_of(req.bias, i0, l, j0, n).to(self.cd)
        for a, b_ in spans:
            allowed = allowed_tile(req, i0, l, a, b_ - a)
            s4[..., a - j0:b_ - j0].masked_fill_(~allowed, float("-inf"))
        return s4.reshape(self.B, self.Hkv, self.g * l, n), graph


def _forward(c: _Ctx, qs, k, v):
    """out (B, H, L, Dv) in compute dtype, lse (B, H, L)."""
    B, Hkv, g, L, Dv = c.B, c.Hkv, c.g, c.L, c.Dv
    qs5 = qs.view(B, Hkv, g, L, qs.shape[-1])
    out = torch.zeros(B, Hkv, g, L, Dv, dtype=c.cd, device=qs.device)
    lse = torch.full((B, Hkv, g, L), float("-inf"), dtype=c.cd, device=qs.device)
    for i0, i1, runs in c.plan.groups:  # query blocks with no run keep out 0, lse -inf
        l = i1 - i0
        qb = c.q_block(qs5, i0, i1)
        m_i = l_i = acc = None
        for j0, j1, spans in runs:
            s, _ = c.scores(qb, k, i0, i1, j0, j1, spans)
            m_new = s.amax(dim=-1, keepdim=True)
            if m_i is not None:
                m_new = torch.maximum(m_i, m_new)
            m_use = m_new.clamp_min(c.lowest)  # -inf row: subtract a finite value, exp gives 0
            p = s.sub_(m_use).exp_()  # in place: s is ours
            pv = torch.matmul(p, v[:, :, j0:j1])  # (B, Hkv, g·l, Dv)
            if m_i is None:
                l_i, acc = p.sum(dim=-1, keepdim=True), pv
            else:
                alpha = (m_i - m_use).exp_()
                l_i = l_i.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
                acc = acc.mul_(alpha).add_(pv)
            m_i = m_new
        acc = acc.div_(torch.where(l_i > 0, l_i, torch.ones_like(l_i)))
        out[:, :, :, i0:i1] = acc.view(B, Hkv, g, l, Dv)
        lse[:, :, :, i0:i1] = (m_i + torch.log(l_i)).view(B, Hkv, g, l)
    return out.view(B, c.H, L, Dv), lse.view(B, c.H, L)


def _backward(c: _Ctx, qs, k, v, out, lse, dout, dlse):
    """dq, dk, dv by recomputing each tile from (q, k, v, lse); O(L + S) extra memory."""
    B, Hkv, g, L, D, Dv = c.B, c.Hkv, c.g, c.L, c.D, c.Dv
    scale = c.req.scale
    qs5 = qs.view(B, Hkv, g, L, D)
    do5 = dout.to(c.cd).view(B, Hkv, g, L, Dv)
    delta = (dout.to(c.cd) * out.to(c.cd)).sum(dim=-1)  # (B, H, L): rowsum(dO ∘ O)
    if dlse is not None:
        delta = delta - dlse.to(c.cd)  # d lse / d s = p, folded into the same term
    delta5 = delta.view(B, Hkv, g, L)
    # lse = -inf (no visible key): use +inf so p = exp(s - lse) = 0 on the whole row
    lse5 = torch.where(torch.isneginf(lse), float("inf"), lse.to(c.cd)).view(B, Hkv, g, L)
    dq = torch.zeros(B, Hkv, g, L, D, dtype=c.cd, device=qs.device)
    dk = torch.zeros(B, Hkv, c.S, D, dtype=c.cd, device=qs.device)
    dv = torch.zeros(B, Hkv, c.S, Dv, dtype=c.cd, device=qs.device)
    bias = c.req.bias
    dbias = torch.zeros(bias.shape, dtype=c.cd, device=bias.device) if c.bias_grad else None
    dcap = [None] * len(c.captured)
    for i0, i1, runs in c.plan.groups:
        l = i1 - i0
        qb = c.q_block(qs5, i0, i1)  # (B, Hkv, g·l, D), already scaled
        dob = do5[:, :, :, i0:i1].reshape(B, Hkv, g * l, Dv)
        lse_b = lse5[:, :, :, i0:i1].reshape(B, Hkv, g * l, 1)
        delta_b = delta5[:, :, :, i0:i1].reshape(B, Hkv, g * l, 1)
        dqb = None
        for j0, j1, spans in runs:
            s, graph = c.scores(qb, k, i0, i1, j0, j1, spans, track=True)
            p = s.sub_(lse_b).exp_()  # (B, Hkv, g·l, n) exact weights
            dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2), dob)  # sums the g heads too
            dp = torch.matmul(dob, v[:, :, j0:j1].transpose(-1, -2))
            ds = p.mul_(dp.sub_(delta_b))  # p ∘ (dp - delta): gradient of the modified score
            n = j1 - j0
            if dbias is not None:  # d bias = ds, summed over the dims the bias broadcasts
                _accumulate_broadcast(dbias, ds.view(B, c.H, l, n), i0, l, j0, n)
            if graph is not None:
                if graph[0] == "dscore":
                    ds = ds.mul_(graph[1].view_as(ds))
                else:
                    s_raw, s_mod = graph
                    grads = torch.autograd.grad(s_mod, [s_raw, *c.captured],
                                                ds.view(B, c.H, l, n).expand_as(s_mod).to(s_mod.dtype),
                                                allow_unused=True)
                    grad = grads[0]
                    for t, gt in enumerate(grads[1:]):
                        if gt is not None:
                            dcap[t] = gt if dcap[t] is None else dcap[t] + gt
                    ds = torch.zeros_like(ds) if grad is None else grad.reshape(B, Hkv, g * l, n).to(c.cd)
            dqb_run = torch.matmul(ds, k[:, :, j0:j1])
            dqb = dqb_run if dqb is None else dqb.add_(dqb_run)
            dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qb)  # qb carries the scale
        dq[:, :, :, i0:i1] = (dqb * scale).view(B, Hkv, g, l, D)
    return dq.view(B, c.H, L, D), dk, dv, dbias, dcap


def _accumulate_broadcast(dst: torch.Tensor, g: torch.Tensor, i0: int, l: int, j0: int, n: int) -> None:
    """dst[..., rows, cols] += g (B, H, l, n) summed over the dims where dst has size 1."""
    dims = [d for d in range(4) if dst.shape[d] == 1 and g.shape[d] != 1]
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    tile_of(dst, i0, l, j0, n).add_(g.to(dst.dtype))


# --- fused run worker ---------------------------------------------------------------
# Without a score_mod, one run is exactly one call of torch's fused CPU flash kernel on
# (q block, k run, v run) with the run's partial tiles as an additive -inf mask; its
# (out_r, lse_r) are merged across runs by the log-sum-exp rule below. Its backward
# kernel, given the *global* out and lse, returns exactly this run's share of dq and
# the run's dk, dv (FA2's decomposition), so the backward is one call per run too.
# bf16/fp16 stay in their dtype for the GEMMs (fp32 scores and statistics inside
# the kernel), as torch SDPA does; partial results are merged in fp32.
def _shift_invariant(mask) -> bool:
    """True when the mask depends only on kv_idx - q_idx (its tiles repeat along the diagonal)."""
    if isinstance(mask, (_masks.Causal, _masks.SlidingWindow)):
        return True
    if isinstance(mask, (_masks.And, _masks.Or, _masks.Not)):
        return all(_shift_invariant(p) for p in mask.parts)
    return False


def _mask_tile(c: _Ctx, i0, i1, j0, j1, spans):
    """Additive mask of one run in the (B', Hkv', g·l, n) layout and its rows with no visible
    key, or (None, None) when nothing is masked. Shift-invariant masks (causal, window) reuse
    the tile of an earlier run at the same diagonal offset."""
    req = c.req
    if not spans and req.bias is None and not c.additive:
        return None, None
    key = None
    if c.tile_cache is not None:
        key = (i0 - j0, i1 - i0, j1 - j0, tuple((a - j0, b - j0) for a, b in spans))
        hit = c.tile_cache.get(key)
        if hit is not None:
            return hit
    l, n = i1 - i0, j1 - j0
    pieces = [allowed_tile(req, i0, l, a, b - a) for a, b in spans]
    bias = None if req.bias is None else tile_of(req.bias, i0, l, j0, n)
    if c.additive:  # alibi / relative_bias: score_mod(s) = s + f(h, q, kv), so f is a bias tile
        b_, h_, q_, kv_ = index_grid(c.B, c.H, i0, l, j0, n, req.q.device)
        mod_bias = req.score_mod.additive_bias(h_, q_, kv_, c.cd, req.q.device)
        bias = mod_bias if bias is None else bias.to(c.cd) + mod_bias
    shapes = [t.shape for t in pieces] + ([] if bias is None else [bias.shape])
    Bm = max(sh[0] for sh in shapes)
    Hm = max(sh[1] for sh in shapes)
    m = torch.zeros(Bm, Hm, l, n, dtype=c.cd, device=req.q.device)
    if bias is not None:
        m += bias.to(c.cd)
    for (a, b), allowed in zip(spans, pieces):
        m[..., a - j0:b - j0].masked_fill_(~allowed, float("-inf"))
    if Hm == 1:  # the same mask for every head: repeat it for the g heads stacked in the rows
        m = m.unsqueeze(2).expand(Bm, 1, c.g, l, n).reshape(Bm, 1, c.g * l, n) if c.g > 1 else m
    else:
        m = m.view(Bm, c.Hkv, c.g * l, n)
    out = (m, torch.isneginf(m).all(dim=-1))
    if key is not None:
        c.tile_cache[key] = out
    return out


def _schedule(c: _Ctx):
    """The plan's groups, with runs of *diagonal* groups folded into batches.

    Consecutive groups that each have one run of the same length at the same
    offset from their rows (a sliding window's interior, say), with the same
    shift-invariant mask tile, become one ``("batch", i0, l, nb, j0, n, spans)``:
    the nb query blocks are stacked as a batch and their key runs are overlapping
    strided views of K/V (``as_strided``, no copy), so the whole band is ONE call
    of the fused kernel instead of nb::

        k:  |----run 0----|
                |----run 1----|          stride l between runs, n keys each
                    |----run 2----|
    """
    if c.schedule is not None:
        return c.schedule
    items = [("group", i0, i1, runs) for i0, i1, runs in c.plan.groups]
    # A batch shares one mask tile: fine for a shift-invariant mask (the tile depends only
    # on the offset), otherwise only for runs that need no mask tile at all.
    shift = c.tile_cache is not None
    plain = c.req.bias is None and not c.additive

    def eligible(runs):
        return len(runs) == 1 and (shift or (plain and not runs[0][2]))

    out, seq = [], []

    def close():
        if len(seq) >= 2:
            _, i0, i1, ((j0, j1, spans),) = seq[0]
            l, n = i1 - i0, j1 - j0
            rel = tuple((a - j0, b - j0) for a, b in spans)
            # cap a call's per-run buffers (q rows, out, lse of the batch)
            nb_max = max(1, BATCH_ELEMS // (c.Hkv * max(n, c.g * l) * max(c.D, c.Dv)))
            for r0 in range(0, len(seq), nb_max):
                nb = min(nb_max, len(seq) - r0)
                out.append(("batch", i0 + r0 * l, l, nb, j0 + r0 * l, n, rel))
        else:
            out.extend(seq)
        seq.clear()

    for it in items:
        _, i0, i1, runs = it
        if eligible(runs) and seq:
            _, p0, p1, ((pj0, pj1, psp),) = seq[-1]
            (j0, j1, sp), l = runs[0], i1 - i0
            same = (i0 == p1 and l == p1 - p0 and j0 - pj0 == l and j1 - j0 == pj1 - pj0
                    and tuple((a - j0, b - j0) for a, b in sp) == tuple((a - pj0, b - pj0) for a, b in psp))
            if same:
                seq.append(it)
                continue
        close()
        if eligible(runs):
            seq.append(it)
        else:
            out.append(it)
    close()
    c.schedule = out
    return out


def _unbatched(schedule):
    """The schedule with each batch expanded back into its per-block groups."""
    for item in schedule:
        if item[0] != "batch":
            yield item
            continue
        _, i0, l, nb, j0, n, rel = item
        for r in range(nb):
            a0, k0 = i0 + r * l, j0 + r * l
            yield ("group", a0, a0 + l, ((k0, k0 + n, tuple((k0 + a, k0 + b) for a, b in rel)),))


def _band(t, b, j0, nb, step, n):
    """Overlapping runs of t[b] (Hkv, S, D): (nb, Hkv, n, D) with run r = keys [j0 + r·step, + n)."""
    st = t.stride()
    return t.as_strided((nb, t.shape[1], n, t.shape[3]), (step * st[2], st[1], st[2], st[3]),
                        t.storage_offset() + b * st[0] + j0 * st[2])


def _rows(t5, b, i0, l, nb):
    """Rows [i0, i0 + nb·l) of t5[b] (Hkv, g, L, X) as a batch (nb, Hkv, g·l, X)."""
    Hkv, g = t5.shape[1], t5.shape[2]
    x = t5[b, :, :, i0:i0 + nb * l].reshape(Hkv, g, nb, l, t5.shape[-1]).permute(2, 0, 1, 3, 4)
    return x.reshape(nb, Hkv, g * l, t5.shape[-1])


def _unrows(dst5, b, i0, l, nb, x):
    """Inverse of _rows: write x (nb, Hkv, g·l, X) into dst5[b, :, :, i0:i0 + nb·l]."""
    Hkv, g = dst5.shape[1], dst5.shape[2]
    dst5[b, :, :, i0:i0 + nb * l] = x.reshape(nb, Hkv, g, l, x.shape[-1]).permute(1, 2, 0, 3, 4).reshape(
        Hkv, g, nb * l, x.shape[-1])


def _forward_fused(c: _Ctx, q, k, v):
    B, Hkv, g, L, Dv = c.B, c.Hkv, c.g, c.L, c.Dv
    q5 = q.view(B, Hkv, g, L, q.shape[-1])
    out = torch.zeros(B, Hkv, g, L, Dv, dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hkv, g, L), float("-inf"), dtype=c.cd, device=q.device)
    scale = c.req.scale
    for item in _schedule(c):
        if item[0] == "batch":
            _, i0, l, nb, j0, n, rel = item
            mask, dead = _mask_tile(c, i0, i0 + l, j0, j0 + n, tuple((j0 + a, j0 + b) for a, b in rel))
            for b in range(B):
                o_r, lse_r = _flash_cpu.forward(_rows(q5, b, i0, l, nb), _band(k, b, j0, nb, l, n),
                                                _band(v, b, j0, nb, l, n), attn_mask=mask, scale=scale, dead_rows=dead)
                lse_r = lse_r.to(c.cd)
                _unrows(out, b, i0, l, nb, o_r)
                _unrows(lse.unsqueeze(-1), b, i0, l, nb, lse_r.unsqueeze(-1))
            continue
        _, i0, i1, runs = item
        l = i1 - i0
        qb = c.q_block(q5, i0, i1)
        acc = lse_i = None
        for j0, j1, spans in runs:
            mask, dead = _mask_tile(c, i0, i1, j0, j1, spans)
            o_r, lse_r = _flash_cpu.forward(qb, k[:, :, j0:j1], v[:, :, j0:j1], attn_mask=mask, scale=scale,
                                            dead_rows=dead)
            lse_r = lse_r.to(c.cd)
            if acc is None:
                acc, lse_i = o_r, lse_r
                continue
            # log-sum-exp merge: lse = log(e^lse_i + e^lse_r), acc = weighted mean of the two
            m = torch.maximum(lse_i, lse_r).clamp_min(c.lowest)
            w_i, w_r = (lse_i - m).exp_(), (lse_r - m).exp_()
            tot = w_i + w_r
            safe = torch.where(tot > 0, tot, torch.ones_like(tot))
            acc = (acc.to(c.cd) * (w_i / safe).unsqueeze(-1)).add_(o_r.to(c.cd) * (w_r / safe).unsqueeze(-1))
            lse_i = m + torch.log(tot)
        out[:, :, :, i0:i1] = acc.view(B, Hkv, g, l, Dv)
        lse[:, :, :, i0:i1] = lse_i.view(B, Hkv, g, l)
    return out.view(B, c.H, L, Dv), lse.view(B, c.H, L)


def _backward_fused(c: _Ctx, q, k, v, out, lse, dout):
    B, Hkv, g, L, D, Dv = c.B, c.Hkv, c.g, c.L, c.D, c.Dv
    q5 = q.view(B, Hkv, g, L, D)
    do5 = dout.reshape(B, Hkv, g, L, Dv)  # a view even for an expanded dO (out.sum().backward())
    o5 = out.view(B, Hkv, g, L, Dv)
    # lse = -inf (no visible key): +inf makes the kernel's p = exp(s - lse) = 0 on the row
    lse5 = torch.where(torch.isneginf(lse), float("inf"), lse).view(B, Hkv, g, L)
    dq = torch.zeros(B, Hkv, g, L, D, dtype=c.cd, device=q.device)
    dk = torch.zeros(B, Hkv, c.S, D, dtype=c.cd, device=q.device)
    dv = torch.zeros(B, Hkv, c.S, Dv, dtype=c.cd, device=q.device)
    scale = c.req.scale
    # The backward runs the diagonal batches block by block: batched, each call's dk, dv per
    # run would be n/l times K's size, and at L = 131072 that memory is what we must not spend.
    for item in _unbatched(_schedule(c)):
        _, i0, i1, runs = item
        l = i1 - i0
        qb = c.q_block(q5, i0, i1)
        dob = c.q_block(do5, i0, i1)
        ob = c.q_block(o5, i0, i1)
        lse_b = lse5[:, :, :, i0:i1].reshape(B, Hkv, g * l)
        dqb = None
        for j0, j1, spans in runs:
            mask, _ = _mask_tile(c, i0, i1, j0, j1, spans)
            dq_r, dk_r, dv_r = _flash_cpu.backward(dob, qb, k[:, :, j0:j1], v[:, :, j0:j1], ob, lse_b,
                                                   attn_mask=mask, scale=scale)
            dqb = dq_r.to(c.cd) if dqb is None else dqb.add_(dq_r)
            dk[:, :, j0:j1] += dk_r
            dv[:, :, j0:j1] += dv_r
        dq[:, :, :, i0:i1] = dqb.view(B, Hkv, g, l, D)
    return dq.view(B, c.H, L, D), dk, dv


class _TiledAttention(torch.autograd.Function):
    """Saves (q, k, v, out, lse) and recomputes tiles in backward.

    Inputs: q, k, v, the float mask (or None), the context, then every tensor the
    score_mod captures that requires grad, so autograd routes their gradients.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, c: _Ctx, *captured):
        if c.fused:
            out, lse = _forward_fused(c, q, k, v)
        else:
            qs, kc, vc = _prepare(c, q, k, v)
            out, lse = _forward(c, qs, kc, vc)
            out = out.to(q.dtype)
        lse = lse if q.dtype in (torch.float32, torch.float64) else lse.float()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.c = c
        ctx.set_materialize_grads(False)  # an unused lse gives dlse = None: no extra work
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        c = ctx.c
        if dout is None:
            dout = torch.zeros_like(out)
        dbias, dcap = None, [None] * len(c.captured)
        if c.fused and dlse is None:
            dq, dk, dv = _backward_fused(c, q, k, v, out, lse, dout)
        else:
            qs, kc, vc = _prepare(c, q, k, v)
            dq, dk, dv, dbias, dcap = _backward(c, qs, kc, vc, out, lse, dout, dlse)
        if dbias is not None:
            dbias = dbias.to(c.req.bias.dtype)
        dcap = [None if g is None else g.to(t.dtype) for g, t in zip(dcap, c.captured)]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, None, *dcap)


def _prepare(c: _Ctx, q, k, v):
    """Upcast (bf16/fp16 → fp32, once) and fold the scale into q."""
    qs = (q.to(c.cd) * c.req.scale).contiguous()
    kc = k.to(c.cd)
    vc = v.to(c.cd)
    return qs, kc, vc


def _launch(req: Request):
    B, H, L, S, D, Dv, Hkv = req.shape
    bm, bn, max_run = _sizes()
    c = _Ctx(req)
    if c.fused:  # the kernel tiles internally: no cap on run length, merge identical query blocks
        plan = _blocks.plan(req.mask, req.dense_mask, B, H, L, S, bm, bn, max(S, bn),
                            max_group_elems=FUSED_MASK_ELEMS, count_all=req.bias is not None or c.additive,
                            memo=req.memo)
    else:
        plan = _blocks.plan(req.mask, req.dense_mask, B, H, L, S, bm, bn, max_run,
                            max_group_elems=bm * max_run, memo=req.memo)
    c.plan = plan
    return _TiledAttention.apply(req.q, req.k, req.v, req.bias, c, *c.captured)


def run(req: Request):
    out, lse = _launch(req)
    return out, lse
