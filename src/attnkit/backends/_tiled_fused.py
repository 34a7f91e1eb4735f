"""The tiled backend's fused worker: one call of torch's private CPU flash kernel per run of keys.

Without a score_mod (or with attnkit's additive alibi / relative_bias, turned into a
bias tile), one run is exactly one call of the kernel (``_flash_cpu``) on
(q block, k run, v run) with the run's partial tiles as an additive -inf mask; its
``(out_r, lse_r)`` are merged across runs by ``_softmax.merge``. Its backward kernel,
given the *global* out and lse, returns exactly this run's share of dq and the run's
dk, dv (FA2's decomposition), so the backward is one call per run too. This is what
makes each step BLAS-sized and fused (the plain worker pays a memory pass per op).

bf16 stays bf16 for the GEMMs (fp32 scores and statistics inside the kernel), as torch
SDPA does; a query block with several runs gets each run's output rounded once to bf16
before the fp32 merge (tests bound the total at 2× SDPA's error). fp16 is given to this
worker upcast to fp32 (``TileContext.kernel_dtype``, see tiled.py).

Chosen by the device's kernel table (``tiled.FLASH_RUNS``; reported by ``attnkit.dispatch``); it never runs a
request it cannot honour: no captured gradients, no float mask requiring grad, no NaN.
"""

from __future__ import annotations

import torch

from .. import masks as _masks
from .. import score_mods as _score_mods
from . import _flash_cpu, _softmax
from ._tiled_ctx import TileContext
from ._tiles import allowed_tile, index_grid, tile_of

__all__ = ["mask_tile", "schedule", "forward", "backward", "causal_pieces", "causal_forward", "causal_backward",
           "BATCH_ELEMS"]

# Largest per-call buffer (elements) of a batch of diagonal runs (see schedule).
BATCH_ELEMS = 1 << 22


def _allowed(c: TileContext, i0: int, l: int, j0: int, n: int) -> torch.Tensor:
    """``allowed_tile`` of a partial tile: there is a mask (or none of the tiles would be partial)."""
    allowed = allowed_tile(c.req, i0, l, j0, n)
    assert allowed is not None, "a partial tile without a mask"
    return allowed


def mask_tile(c: TileContext, i0, i1, j0, j1, spans):
    """Additive mask of one run in the (B', Hkv', g·l, n) layout and its rows with no visible
    key, or (None, None) when nothing is masked. Shift-invariant masks (causal, window) reuse
    the tile of an earlier run at the same diagonal offset."""
    req = c.req
    if not spans and req.bias is None and not c.additive:
        return None, None
    hit = c.verified.get((i0, i1, j0, j1, spans))  # a tile schedule() found equal to its batch's first
    if hit is not None:
        return hit
    key = None
    cache = c.tile_cache
    if cache is not None:
        key = (i0 - j0, i1 - i0, j1 - j0, tuple((a - j0, b - j0) for a, b in spans))
        hit = cache.get(key)
        if hit is not None:
            return hit
    l, n = i1 - i0, j1 - j0
    pieces = [_allowed(c, i0, l, a, b - a) for a, b in spans]
    bias = None if req.bias is None else tile_of(req.bias, i0, l, j0, n)
    if c.additive:  # alibi / relative_bias: score_mod(s) = s + f(h, q, kv), so f is a bias tile
        _, h_, q_, kv_ = index_grid(c.B, c.H, i0, l, j0, n, req.q.device)
        mod = req.score_mod
        assert isinstance(mod, _score_mods.ScoreMod), "c.additive: one of attnkit's additive score_mods"
        mod_bias = mod.additive_bias(h_, q_, kv_, c.cd, req.q.device)
        bias = mod_bias if bias is None else bias.to(c.cd) + mod_bias
    shapes = [t.shape for t in pieces] + ([] if bias is None else [bias.shape])
    Bm = max(sh[0] for sh in shapes)
    Hm = max(sh[1] for sh in shapes)
    m = torch.zeros(Bm, Hm, l, n, dtype=c.cd, device=req.q.device)
    if bias is not None:
        m += bias.to(c.cd)
    for (a, b), allowed in zip(spans, pieces, strict=True):
        m[..., a - j0:b - j0].masked_fill_(~allowed, float("-inf"))
    if Hm == 1:  # the same mask for every head: repeat it for the g heads stacked in the rows
        m = m.unsqueeze(2).expand(Bm, 1, c.g, l, n).reshape(Bm, 1, c.g * l, n) if c.g > 1 else m
    else:
        m = m.view(Bm, c.Hkv, c.g * l, n)
    out = (m, torch.isneginf(m).all(dim=-1))
    if cache is not None and key is not None:
        cache[key] = out
    return out




def schedule(c: TileContext):
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
    assert c.plan is not None, "the launcher sets the work list first"
    items = [("group", i0, i1, runs) for i0, i1, runs in c.plan.groups]
    # A batch shares one mask tile: fine for a mask known to be shift-invariant (the tile
    # depends only on the offset), for runs that need no mask tile at all, and for any other
    # mask (an opaque sliding-window mask_mod, say) where every group's tile has been evaluated
    # and found exactly equal to the batch's first: detected from the tiles, not the mask's type.
    shift = c.tile_cache is not None
    plain = c.req.bias is None and not c.additive
    check = not shift and plain and c.req.dense_mask is None and c.req.mask is not None

    def eligible(runs):
        return len(runs) == 1 and (shift or (plain and not runs[0][2]) or check)

    out: list[tuple] = []  # ("group", i0, i1, runs) or ("batch", i0, l, nb, j0, n, rel)
    seq: list[tuple] = []  # the ("group", ...) items of the diagonal batch being gathered

    def close():
        if check and len(seq) >= 2 and seq[0][3][0][2]:
            parts = _equal_tiles(c, seq)
            seq.clear()
            for part in parts:
                seq.extend(part)
                emit()
        else:
            emit()

    def emit():
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


def _equal_tiles(c: TileContext, seq):
    """Split diagonal groups into maximal stretches whose mask tiles are exactly equal (content
    compared with ``torch.equal``, never assumed). Without a bias or score_mod a group's tile is
    a function of its bool pieces (``allowed_tile`` per span, same relative spans along ``seq``),
    so those are compared; the first tile of each stretch of two or more is built once and
    recorded for all its groups in ``c.verified`` (forward and backward reuse it)."""
    parts: list[list[tuple]] = []
    firsts: list[list[torch.Tensor] | None] = []
    for it in seq:
        _, i0, i1, ((j0, j1, spans),) = it
        pieces = [_allowed(c, i0, i1 - i0, a, b - a) for a, b in spans]
        first = firsts[-1] if firsts else None
        # seq's groups have the same relative spans: as many pieces as the first's
        if first is not None and all(x.shape == y.shape and torch.equal(x, y)
                                     for x, y in zip(pieces, first, strict=True)):
            parts[-1].append(it)
        else:
            if parts and len(parts[-1]) < 2:
                firsts[-1] = None  # a lone group keeps nothing (memory: one tile per stretch)
            parts.append([it])
            firsts.append(pieces)
    for part in parts:
        if len(part) >= 2:
            _, i0, i1, ((j0, j1, spans),) = part[0]
            tile = mask_tile(c, i0, i1, j0, j1, spans)
            for _, a0, a1, ((k0, k1, sp),) in part:
                c.verified[(a0, a1, k0, k1, sp)] = tile
    return parts


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


def forward(c: TileContext, q, k, v):
    B, Hkv, g, L, Dv = c.B, c.Hkv, c.g, c.L, c.Dv
    q5 = q.view(B, Hkv, g, L, q.shape[-1])
    out = torch.zeros(B, Hkv, g, L, Dv, dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hkv, g, L), float("-inf"), dtype=c.cd, device=q.device)
    scale = c.req.scale
    for item in schedule(c):
        if item[0] == "batch":
            _, i0, l, nb, j0, n, rel = item
            mask, dead = mask_tile(c, i0, i0 + l, j0, j0 + n, tuple((j0 + a, j0 + b) for a, b in rel))
            for b in range(B):
                # the batch of this call is the nb stacked query blocks of batch row b: a mask tile that
                # differs per batch row (Bm = B) gives that row's tile to all nb of them
                mb, db = (mask, dead) if mask is None or mask.shape[0] == 1 else (mask[b:b + 1], dead[b:b + 1])
                o_r, lse_r = _flash_cpu.forward(_rows(q5, b, i0, l, nb), _band(k, b, j0, nb, l, n),
                                                _band(v, b, j0, nb, l, n), attn_mask=mb, scale=scale, dead_rows=db)
                lse_r = lse_r.to(c.cd)
                _unrows(out, b, i0, l, nb, o_r)
                _unrows(lse.unsqueeze(-1), b, i0, l, nb, lse_r.unsqueeze(-1))
            continue
        _, i0, i1, runs = item
        l = i1 - i0
        qb = c.q_block(q5, i0, i1)
        acc = lse_i = None
        for j0, j1, spans in runs:
            mask, dead = mask_tile(c, i0, i1, j0, j1, spans)
            o_r, lse_r = _flash_cpu.forward(qb, k[:, :, j0:j1], v[:, :, j0:j1], attn_mask=mask, scale=scale,
                                            dead_rows=dead)
            lse_r = lse_r.to(c.cd)
            if acc is None:
                acc, lse_i = o_r, lse_r
                continue
            # runs of one query block cover disjoint keys: merge by log-sum-exp, fp32 accumulators
            acc, lse_i = _softmax.merge(acc.to(c.cd), lse_i, o_r.to(c.cd), lse_r)
        assert acc is not None and lse_i is not None, "a work-list group has at least one run"
        out[:, :, :, i0:i1] = acc.view(B, Hkv, g, l, Dv)
        lse[:, :, :, i0:i1] = lse_i.view(B, Hkv, g, l)
    return out.view(B, c.H, L, Dv), lse.view(B, c.H, L)


def backward(c: TileContext, q, k, v, out, lse, dout):
    B, Hkv, g, L, D, Dv = c.B, c.Hkv, c.g, c.L, c.D, c.Dv
    q5 = q.view(B, Hkv, g, L, D)
    do5 = dout.reshape(B, Hkv, g, L, Dv)  # a view even for an expanded dO (out.sum().backward())
    o5 = out.view(B, Hkv, g, L, Dv)
    lse5 = _softmax.lse_for_backward(lse).view(B, Hkv, g, L)
    dq = torch.zeros(B, Hkv, g, L, D, dtype=c.cd, device=q.device)
    dk = torch.zeros(B, Hkv, c.S, D, dtype=c.cd, device=q.device)
    dv = torch.zeros(B, Hkv, c.S, Dv, dtype=c.cd, device=q.device)
    scale = c.req.scale
    # The backward runs the diagonal batches block by block: batched, each call's dk, dv per
    # run would be n/l times K's size, and at L = 131072 that memory is what we must not spend.
    for item in _unbatched(schedule(c)):
        _, i0, i1, runs = item
        l = i1 - i0
        qb = c.q_block(q5, i0, i1)
        dob = c.q_block(do5, i0, i1)
        ob = c.q_block(o5, i0, i1)
        lse_b = lse5[:, :, :, i0:i1].reshape(B, Hkv, g * l)
        dqb = None
        for j0, j1, spans in runs:
            mask, _ = mask_tile(c, i0, i1, j0, j1, spans)
            dq_r, dk_r, dv_r = _flash_cpu.backward(dob, qb, k[:, :, j0:j1], v[:, :, j0:j1], ob, lse_b,
                                                   attn_mask=mask, scale=scale)
            dqb = dq_r.to(c.cd) if dqb is None else dqb.add_(dq_r)
            dk[:, :, j0:j1] += dk_r
            dv[:, :, j0:j1] += dv_r
        assert dqb is not None, "a work-list group has at least one run"
        dq[:, :, :, i0:i1] = dqb.view(B, Hkv, g, l, D)
    return dq.view(B, c.H, L, D), dk, dv


# --- causal alone: the kernel's own causal block skipping is the plan ------------------------

def causal_pieces(req, given) -> tuple | None:
    """For a mask that is exactly ``causal`` (no other mask, bias or score_mod, no explicit plan):
    the key ranges ``(j0, j1, is_causal)`` that cover it with the kernel's top-left ``is_causal``,
    or None. Top-left (or L = S): one call over all keys. Bottom-right with L < S: the keys
    every row sees, unmasked, then the last L keys top-left causal, merged by log-sum-exp::

        L = 2, S = 5, bottom-right:   k0 k1 k2 | k3 k4
                                  q0   #  #  #  |  #  .      [0, 3) no mask + [3, 5) is_causal
                                  q1   #  #  #  |  #  #

    The kernel skips the blocks above its diagonal itself, in blocks of its own size: BLAS-sized
    steps instead of one call per 128-row query block. No row is fully masked here.
    """
    if (type(req.mask) is not _masks.Causal or req.dense_mask is not None or req.bias is not None
            or req.score_mod is not None or given is not None):
        return None
    L, S = req.q.shape[2], req.k.shape[2]
    if req.mask.align == "top_left" or L == S:
        return ((0, S, True),)
    if L < S:
        return ((0, S - L, False), (S - L, S, True))
    return None  # bottom-right with L > S: the first rows see nothing, left to the block plan


def causal_forward(c: TileContext, q, k, v):
    """Forward over ``c.causal`` pieces: one kernel call per piece and query-head group (GQA: the
    g query heads of a kv head are called in turn on the same K/V, never copied)."""
    B, Hkv, g, L, D, Dv = c.B, c.Hkv, c.g, c.L, c.D, c.Dv
    q5 = q.view(B, Hkv, g, L, D)
    out = torch.empty(B, Hkv, g, L, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hkv, g, L, dtype=c.cd, device=q.device)
    assert c.causal is not None, "the launcher sets the causal pieces first"
    for j in range(g):
        acc = lse_i = None
        for j0, j1, is_causal in c.causal:
            o_r, lse_r = _flash_cpu.forward(q5[:, :, j], k[:, :, j0:j1], v[:, :, j0:j1], is_causal=is_causal,
                                            scale=c.req.scale)
            lse_r = lse_r.to(c.cd)
            if acc is None:
                acc, lse_i = o_r, lse_r
            else:
                acc, lse_i = _softmax.merge(acc.to(c.cd), lse_i, o_r.to(c.cd), lse_r)
        assert acc is not None and lse_i is not None, "causal_pieces gives at least one piece"
        out[:, :, j] = acc
        lse[:, :, j] = lse_i
    return out.view(B, c.H, L, Dv), lse.view(B, c.H, L)


def causal_backward(c: TileContext, q, k, v, out, lse, dout):
    """Backward of :func:`causal_forward`: each piece's share of dq and its dk, dv, given the
    global out and lse (FA2's decomposition, as ``backward``)."""
    B, Hkv, g, L, D, Dv = c.B, c.Hkv, c.g, c.L, c.D, c.Dv
    q5 = q.view(B, Hkv, g, L, D)
    do5 = dout.reshape(B, Hkv, g, L, Dv)
    o5 = out.view(B, Hkv, g, L, Dv)
    lse5 = _softmax.lse_for_backward(lse).view(B, Hkv, g, L)
    dq = torch.zeros(B, Hkv, g, L, D, dtype=c.cd, device=q.device)
    dk = torch.zeros(B, Hkv, c.S, D, dtype=c.cd, device=q.device)
    dv = torch.zeros(B, Hkv, c.S, Dv, dtype=c.cd, device=q.device)
    assert c.causal is not None, "the launcher sets the causal pieces first"
    for j in range(g):
        for j0, j1, is_causal in c.causal:
            dq_r, dk_r, dv_r = _flash_cpu.backward(do5[:, :, j], q5[:, :, j], k[:, :, j0:j1], v[:, :, j0:j1],
                                                   o5[:, :, j], lse5[:, :, j], is_causal=is_causal, scale=c.req.scale)
            dq[:, :, j] += dq_r
            dk[:, :, j0:j1] += dk_r
            dv[:, :, j0:j1] += dv_r
    return dq.view(B, c.H, L, D), dk, dv
