"""The per-pair math: partial results ``(out, c, r)`` of a rank's rows against one key rank, their merge,
and the backward of a pair (FlashAttention-2's decomposition)."""

from __future__ import annotations

import math

import torch

from .. import masks as _masks
from ..api import attention as _attention
from ..backends import _softmax


def _block(q, k, v, qpos, kpos, kind, *, gmod, score_mod, scale, pure_causal=False, band=None, shift=None):
    """Partial ``(out, lse)`` of local queries at global positions ``qpos`` against keys at ``kpos``
    (one block of a pair, see :meth:`Schedule.blocks`): "full" no mask, "causal" plain causal
    (the same positions on both sides: j ≤ i ⇔ kpos[j] ≤ qpos[i]), "mask" the global mask at those
    positions (a ``from_mod`` on the index maps). A score_mod always sees global positions.
    ``shift (B, H, n)``: subtracted from each row's scores after the score_mod (the softmax is
    unchanged; the lse returned is the block's lse − shift). ``band``: the window size when the global
    mask is a sliding window — a block of contiguous positions whose last query and last key are the
    same position is then the built-in ``sliding_window(band)`` itself (closed-form tiles, the fused
    kernels), not index maps::

        global positions 100-103 (queries) × 98-103 (keys), window 3:  S − L = 2 = 100 − 98
        → sliding_window(3) on the block's own indices"""
    mask = None
    causal = kind == "causal"
    if kind == "mask" and band is not None and _band_aligned(qpos, kpos):
        mask = _masks.sliding_window(band)
    elif kind == "mask" and gmod is not None:
        def pair_mask(b, h, qi, ki):
            return gmod(b, h, qpos.to(qi.device)[qi], kpos.to(ki.device)[ki])
        mask = _masks.from_mod(pair_mask)
    sm = None
    if score_mod is not None or shift is not None:
        def sm(score, b, h, qi, ki):
            if score_mod is not None:
                score = score_mod(score, b, h, qpos.to(qi.device)[qi], kpos.to(ki.device)[ki])
            return score if shift is None else score - shift.to(score.device, score.dtype)[b, h, qi]
    return _attention(q, k, v, mask=mask, causal=causal, score_mod=sm, scale=scale, return_lse=True)


def _band_aligned(qpos, kpos) -> bool:
    """Both position runs contiguous and ending at the same position (see :func:`_block`)."""
    n, m = len(qpos), len(kpos)
    if not n or not m:
        return False
    q0, q1, k0, k1 = (int(x) for x in (qpos[0], qpos[-1], kpos[0], kpos[-1]))
    return q1 == k1 and q1 - q0 == n - 1 and k1 - k0 == m - 1 and m >= n


def _band_of(base) -> int | None:
    """The window size when ``base`` is a sliding window (alone, or with causal: the same mask)."""
    parts = list(getattr(base, "parts", ())) if isinstance(base, _masks.And) else [base]
    sizes = [p.size for p in parts if isinstance(p, _masks.SlidingWindow)]
    if not sizes or any(not isinstance(p, (_masks.SlidingWindow, _masks.Causal)) for p in parts):
        return None
    return min(sizes)


def _block_exact(q, k, v, qpos, kpos, kind, opts):
    """A block's partial result as ``(out, c, r)``, its lse kept in two parts: ``lse = c + r``.

    Ordinary rows: ``c = lse``, ``r = 0``. A row whose lse is finite and huge (every score near
    ``finfo.min`` or −1e9: a score_mod that pads whole rows) cannot be merged by lse alone, which
    rounds to the row max there (two shards of n keys each would merge with weights 1 and 1, not
    ½ and ½). Such rows are computed again with their scores shifted by ``c`` = the first lse
    (within an ulp of the row max, so the shifted scores are moderate), and ``r`` is the exact lse
    of the shifted scores. The second pass runs only when such rows exist."""
    o, lse = _block(q, k, v, qpos, kpos, kind, **opts)
    bad = _softmax.inexact_rows(lse)
    if not bool(bad.any()):
        return o, lse, torch.zeros_like(lse)
    shift = torch.where(bad, lse, torch.zeros_like(lse)).detach()
    o2, l2 = _block(q, k, v, qpos, kpos, kind, **opts, shift=shift)
    return o2, torch.where(bad, shift, l2), torch.where(bad, l2, torch.zeros_like(l2))


def _merge(a, b):
    """Merge two partials ``(out, c, r)`` (``lse = c + r``, :func:`_block_exact`) of the same rows over
    disjoint keys, exact on rows of huge finite scores too: with ``c = max(c_a, c_b)`` the weights
    are ``exp((c_a − c) + r_a)`` and ``exp((c_b − c) + r_b)``. A dead side (``c = −inf``) contributes
    nothing; both dead: out 0, c −inf, r 0."""
    out_a, c_a, r_a = a
    out_b, c_b, r_b = b
    c = torch.maximum(c_a, c_b)
    cg = _softmax.guard(c)
    e_a, e_b = (c_a - cg) + r_a, (c_b - cg) + r_b
    top = _softmax.guard(torch.maximum(e_a, e_b))  # exp() stays in range whatever the r's are
    w_a, w_b = (e_a - top).exp(), (e_b - top).exp()
    tot = w_a + w_b
    safe = torch.where(tot > 0, tot, torch.ones_like(tot))
    out = out_a * (w_a / safe).unsqueeze(-1) + out_b * (w_b / safe).unsqueeze(-1)
    r = torch.where(torch.isneginf(c), torch.zeros_like(c), top + torch.log(safe))
    return out, c, r


def _pair(q, k, v, qpos, kpos, blocks, opts):
    """Partial ``(out, c, r)`` of a pair (``lse = c + r``, :func:`_block_exact`) from its blocks: one
    block is returned as it is; several are merged into their rows in block order (fp32; rows seeing
    no block: 0, -inf, 0)."""
    if len(blocks) == 1 and blocks[0][:4] == (0, q.shape[2], 0, k.shape[2]):
        return _block_exact(q, k, v, qpos, kpos, blocks[0][4], opts)
    acc = _acc_dtype(q.dtype)
    B, H, n = q.shape[:3]
    out = q.new_zeros(B, H, n, v.shape[-1], dtype=acc)
    c = q.new_full((B, H, n), float("-inf"), dtype=acc)
    r = q.new_zeros((B, H, n), dtype=acc)
    for qa, qb, ka, kb, kind in blocks:  # merged into their rows in block order (a row may get several)
        part = _block_exact(q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb], qpos[qa:qb], kpos[ka:kb], kind, opts)
        part = tuple(t.to(acc) for t in part)
        rows = (out[:, :, qa:qb], c[:, :, qa:qb], r[:, :, qa:qb])
        out[:, :, qa:qb], c[:, :, qa:qb], r[:, :, qa:qb] = _merge(rows, part)
    return out, c, r


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rank_forward(q, kv: dict, rank: int, qpos, positions, blocks: dict, opts, partials=None, Dv=None):
    """Merge the partial results of the key ranks in ``kv`` for the queries of ``rank``, in the order
    they stream in (:func:`_order`; ``partials``: those already computed, e.g. the local pair).
    Returns ``(out, c, r)``: the rows' lse is ``c + r``, kept in two parts (:func:`_block_exact`)."""
    acc = _acc_dtype(q.dtype)
    partials = dict(partials or {})
    res = None
    for s in _order(rank, len(positions)):
        if s not in kv:
            continue
        if s not in partials:
            partials[s] = _pair(q, kv[s][0], kv[s][1], qpos, positions[s], blocks[s], opts)
        part = tuple(t.to(acc) for t in partials.pop(s))
        res = part if res is None else _merge(res, part)
    if res is None:  # no visible key at all
        B, H, n = q.shape[0], q.shape[1], q.shape[2]
        Dv = next(iter(kv.values()))[1].shape[-1] if kv else (q.shape[-1] if Dv is None else Dv)
        res = (q.new_zeros(B, H, n, Dv, dtype=acc), q.new_full((B, H, n), float("-inf"), dtype=acc),
               q.new_zeros((B, H, n), dtype=acc))
    return res


def _block_backward_fused(q, k, v, kind, opts, out, lse_b, dout):
    """FlashAttention-2's decomposition on torch's CPU flash backward kernel: given the rows'
    *global* ``out`` and ``lse`` (+inf on dead rows), the kernel's ``p = exp(s - lse)`` and
    ``D = rowsum(dout·out)`` make its (dq, dk, dv) exactly this block's share. For "full" and
    "causal" blocks with no score_mod, D == Dv, fp32/fp64 and no gradient on lse; None otherwise
    (the caller recomputes the block with autograd)."""
    from ..backends import _flash_cpu
    causal = kind == "causal"
    if kind not in ("full", "causal") or opts["score_mod"] is not None or q.shape[-1] != v.shape[-1]:
        return None
    if q.dtype not in (torch.float32, torch.float64) or out.dtype != q.dtype or q.device.type != "cpu":
        return None
    if not _flash_cpu.available():
        return None
    B, H, n, D = q.shape
    Hkv, m = k.shape[1], k.shape[2]
    g = H // Hkv
    scale = opts["scale"] if opts["scale"] is not None else 1.0 / math.sqrt(D)
    def c(t):
        return t.contiguous()

    if g == 1 or causal:  # causal rows cannot be folded (the kernel's diagonal would move): expand K/V
        kk = k if g == 1 else k.repeat_interleave(g, dim=1)
        vv = v if g == 1 else v.repeat_interleave(g, dim=1)
        dq, dk, dv = _flash_cpu.backward(c(dout), c(q), c(kk), c(vv), c(out), lse_b.contiguous(), is_causal=causal,
                                         scale=scale)
        if g > 1:
            dk = dk.reshape(B, Hkv, g, m, D).sum(2)
            dv = dv.reshape(B, Hkv, g, m, v.shape[-1]).sum(2)
        return dq, dk, dv
    def fold(t):  # the g query heads of a kv head as rows
        return t.contiguous().view(B, Hkv, g * n, t.shape[-1])

    dq, dk, dv = _flash_cpu.backward(fold(dout), fold(q), c(k), c(v), fold(out),
                                     lse_b.contiguous().view(B, Hkv, g * n), scale=scale)
    return dq.reshape(B, H, n, D), dk, dv


class _RowsBackward:
    """The backward of one rank's query rows, one key rank's pair at a time (:meth:`pair`), so the
    pairs can stream through in any order: dq and the captured tensors' gradients accumulate here.

    Block by block: the fused FA2 kernel where it applies, else the block recomputed with autograd
    and weighted by the global lse (``w = exp(lse_block - lse)``: its share of each row).
    ``lse2 = (c, r)``: the rows' lse in two parts (:func:`_block_exact`); a block holding rows of
    huge finite lse is recomputed with those rows' scores shifted by ``c``, so its share is
    ``exp(lse_shifted − r)``, exact."""

    def __init__(self, q, qpos, positions, opts, out, lse2, dout, dlse, captured):
        self.acc = acc = _acc_dtype(q.dtype)
        self.q, self.qpos, self.positions, self.opts, self.out = q, qpos, positions, opts, out
        self.c_all, self.r_all = lse2
        self.lse_b = _softmax.lse_for_backward(self.c_all + self.r_all)
        self.bad = _softmax.inexact_rows(self.c_all)
        self.dout = dout.to(acc) if dout is not None else torch.zeros_like(out)
        self.dlse, self.captured = dlse, captured
        self.dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        self.cap: list[torch.Tensor | None] = [None] * len(captured)

    def pair(self, s: int, k_s, v_s, blocks, kpos=None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (dk, dv) partial for key rank ``s`` (acc dtype); adds to dq and the captured grads.
        ``kpos``: the global positions of ``k_s``'s rows (default: all of rank s's)."""
        kpos_s = self.positions[s] if kpos is None else kpos
        acc, q, opts, dq, dlse = self.acc, self.q, self.opts, self.dq, self.dlse
        dk = torch.zeros(k_s.shape, dtype=acc, device=k_s.device)
        dv = torch.zeros(v_s.shape, dtype=acc, device=v_s.device)
        for qa, qb, ka, kb, kind in blocks:
            qs, ks, vs = q[:, :, qa:qb], k_s[:, :, ka:kb], v_s[:, :, ka:kb]
            o_g, l_g, d_g = self.out[:, :, qa:qb], self.lse_b[:, :, qa:qb], self.dout[:, :, qa:qb]
            b_g = self.bad[:, :, qa:qb]
            shifted = bool(b_g.any())
            fast = None if dlse is not None or shifted else _block_backward_fused(qs, ks, vs, kind, opts, o_g, l_g,
                                                                                   d_g)
            if fast is not None:
                dq[:, :, qa:qb] += fast[0].to(acc)
                dk[:, :, ka:kb] += fast[1].to(acc)
                dv[:, :, ka:kb] += fast[2].to(acc)
                continue
            kpos = kpos_s[ka:kb]
            with torch.enable_grad():
                qq, kk, vv = (t.detach().requires_grad_() for t in (qs, ks, vs))
                base = l_g
                if shifted:
                    shift = torch.where(b_g, self.c_all[:, :, qa:qb], torch.zeros_like(l_g))
                    o, l = _block(qq, kk, vv, self.qpos[qa:qb], kpos, kind, **opts, shift=shift)
                    base = torch.where(b_g, self.r_all[:, :, qa:qb], l_g)
                else:
                    o, l = _block(qq, kk, vv, self.qpos[qa:qb], kpos, kind, **opts)
                w = torch.exp(l.detach().to(acc) - base)  # this block's share of each row (0 on dead rows)
                g_l = w * (d_g * (o.detach().to(acc) - o_g)).sum(-1)
                if dlse is not None:
                    g_l = g_l + w * dlse[:, :, qa:qb].to(acc)
                g_o = d_g * w.unsqueeze(-1)
                grads = torch.autograd.grad([o, l], [qq, kk, vv, *self.captured],
                                            [g_o.to(o.dtype), g_l.to(l.dtype)], allow_unused=True)
            for t, g, sl in ((dq, grads[0], (qa, qb)), (dk, grads[1], (ka, kb)), (dv, grads[2], (ka, kb))):
                if g is not None:
                    t[:, :, sl[0]:sl[1]] += g.to(acc)
            for i, g in enumerate(grads[3:]):
                if g is not None:
                    prev = self.cap[i]
                    self.cap[i] = g if prev is None else prev + g
        return dk, dv


def _order(r: int, W: int) -> list[int]:
    """The key ranks of query rank r in the order their K/V stream in (and their partial results
    are merged): r itself, then round d = 1, 2, … brings rank (r − d) mod W."""
    return [(r - d) % W for d in range(W)]


def _owner_order(s: int, W: int) -> list[int]:
    """The order in which key rank s sums the dK/dV partials sent back to it: its own, then round d
    brings rank (s + d) mod W's."""
    return [(s + d) % W for d in range(W)]


def _rank_backward(q, kv: dict, rank: int, qpos, positions, blocks: dict, opts, out, lse2, dout, dlse, captured):
    """dq of this rank, the (dk, dv) partials for each key rank in ``kv`` (acc dtype), and the
    gradients of the score_mod's captured tensors (local share), pairs in :func:`_order`."""
    rows = _RowsBackward(q, qpos, positions, opts, out, lse2, dout, dlse, captured)
    parts = {}
    for s in _order(rank, len(positions)):
        if s in kv:
            parts[s] = rows.pair(s, kv[s][0], kv[s][1], blocks[s])
    return rows.dq, parts, rows.cap


def _options(seq_len, mask, causal, scale, score_mod):
    base = mask
    if causal:
        base = _masks.causal() if base is None else (base & _masks.causal())
    gmod = None if base is None else base.bind(seq_len, seq_len)
    # with L = S both alignments of causal are the same mask
    return base, dict(gmod=gmod, score_mod=score_mod, scale=scale, pure_causal=isinstance(base, _masks.Causal),
                      band=_band_of(base))


_UNSUPPORTED = {"dropout_p": 0.0, "sinks": None, "return_weights": False, "mask": None, "backend": "auto"}


def _check_unsupported(kw):
    """Refuse the single-process options context parallelism does not take (defaults pass)."""
    extra = sorted(set(kw) - set(_UNSUPPORTED))
    if extra:
        raise TypeError(f"attention: unexpected keyword(s) {extra}.")
    for name, value in kw.items():
        default = _UNSUPPORTED[name]
        same = value is default if default is None or isinstance(default, bool) else (
            isinstance(value, (int, float, str)) and not isinstance(value, bool) and value == default)
        if not same:
            raise ValueError(f"{name}: not supported by context-parallel attention (got {value!r}); the mask "
                             "is fixed at construction (ContextParallel(mask=...)); dropout, sinks, weights and "
                             "named backends are single-process options.")


def _captured(score_mod):
    if score_mod is None:
        return []
    if hasattr(score_mod, "tensors"):
        return [t for t in score_mod.tensors() if isinstance(t, torch.Tensor) and t.requires_grad]
    from .. import _mods
    return _mods.captured_grad_tensors(score_mod)
