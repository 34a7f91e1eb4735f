"""The tile-mass engine: where each block of queries sends its attention, over long inputs.

The fourth way attnkit computes attention, beside the reference, eager and tiled backends: from a
validated request (q, k, mask), the exact softmax mass of every tile, never an L×S tensor. The
public door is :func:`attnkit.tile_mass` (``attnkit/tilemass.py``); the page that draws a
:class:`TileMass` is :mod:`attnkit.viz`'s, reached through ``attnkit._display``.

Shape legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim.  q ``(B, H, L, D)``, k ``(B, Hkv, S, D)`` (GQA: query head ``h`` uses kv head
``h // (H // Hkv)``).

The scores are cut into tiles of ``bm`` query rows × ``bn`` key columns, as in a
:class:`attnkit.BlockPlan`. The **mass** of a tile is the exact sum of the softmax weights
inside it; a query row's weights sum to 1 over its keys, so the masses of one row of tiles
add up to the number of live rows of that query block::

                  key block 0   key block 1   key block 2         mass[qb, kb] = Σ_{i in qb} Σ_{j in kb} w_ij
                 ┌─────────────┬─────────────┬─────────────┐
  query block 0  │   P  13.0   │   .         │   .         │      13.0                   = 13  live rows (3 dead)
  query block 1  │   F  40.2   │   P  23.8   │   .         │      40.2 + 23.8            = 64
  query block 2  │   .         │   F  51.5   │   P  12.5   │      51.5 + 12.5            = 64
                 └─────────────┴─────────────┴─────────────┘
                 share[qb, kb] = mass / live rows of qb: the fraction of that block's attention
                 landing in kb (the colour of the map); "." = empty tile of the plan: never computed.

How it is computed (:func:`run`), per query block and all heads at once, over the
key runs the plan leaves (adjacent non-empty tiles, one GEMM each, GQA heads stacked in
the GEMM's rows so K is never copied)::

    s      = q_blk @ k_runᵀ · scale  (+ score_mod, bias, mask on the run)     (B, H, bm, n)
    m_r    = rowmax(s)                        per run; dead rows guarded (no -inf - -inf)
    part_r = Σ_{j in each key block} exp(s - m_r)                             (B, H, bm, blocks of the run)
    M      = max_r m_r ;  l = Σ_r Σ part_r · exp(m_r - M)                     the row's softmax denominator
    w      = part_r · exp(m_r - M) / l        a row's weight in each key block (0 on a dead row)
    mass   = Σ_rows w ;  lse = M + log l      (lse equals attnkit.attention(..., return_lse=True)'s)

The row statistics are rebuilt from the scores of the same pass rather than read from a
kernel's lse: the scores are computed once, and a row whose scores are all a huge finite
negative (``finfo.min`` padding in a float bias) still gets weights that sum to 1, where
``exp(s - lse)`` with an fp32 lse would not (the conventions page: gradients are exact on every row).
Memory: the result
``(B, H, tiles)`` plus one query block's scores; never an L×S tensor.

Exact weights on demand, from the same q, k and mask: :meth:`TileMass.row_weights` (one
query row over all keys) and :meth:`TileMass.tile_weights` (one tile, normalised by its
rows' full softmax).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .. import _tiling
from .. import plans as _plans
from .._display import html
from .._tiling import EMPTY, PARTIAL
from . import _softmax
from ._tiles import modify_scores
from ._worklist import _runs_from_grid

__all__ = ["TileMass", "run", "MAX_RUN"]

MAX_RUN = 2048  # keys per GEMM: a (B·H·bm × MAX_RUN) fp32 score tile stays a few MB


def _live_kinds(req, block) -> torch.Tensor:
    """``(nq, nk)`` tile kinds valid for every (batch, head): EMPTY tiles are skipped."""
    B, H, L, S, *_ = req.shape
    bm, bn = block
    nq, nk = -(-L // bm), -(-S // bn)
    if req.plan is not None and req.plan.block == block and req.plan_extra is None:
        kinds = req.plan.collapsed()
    elif req.mask is not None:
        kinds = _tiling.collapse(_plans.plan(req.mask, L, S, B=B, H=H, block=block).kinds)
    else:
        kinds = torch.full((nq, nk), _tiling.FULL, dtype=torch.int8)
    if req.dense_mask is not None:  # a user bool tensor: its own tiles (one pass over it)
        dk = _tiling.collapse(_tiling.reduce_allowed(req.dense_mask, bm, bn))
        kinds = torch.minimum(kinds, dk.expand(nq, nk) if dk.shape != (nq, nk) else dk)
    if req.bias is not None or req.score_mod is not None:  # scores are modified on every tile
        kinds = torch.where(kinds == EMPTY, kinds, torch.full_like(kinds, PARTIAL))
    return kinds


def _runs_of(kinds: torch.Tensor, block, S: int, max_run: int):
    """For each query block, its runs of adjacent non-empty key blocks, capped at ``max_run`` keys:
    ``(first key block, end key block, any partial tile)``, found as the tiled backend finds its runs."""
    bn = block[1]
    return [[(j0 // bn, -(-j1 // bn), bool(spans)) for j0, j1, spans in runs]
            for runs in _runs_from_grid(kinds, S, bn, max(1, max_run // bn))]


class TileMass:
    """The attention mass of every non-empty tile, per batch row and head (see the module picture).

    Attributes:
        mass: float32 ``(B, H, T)``, the exact sum of the weights in each of the ``T`` tiles.
        tiles: int64 ``(T, 2)``, the ``(query block, key block)`` of each, sorted row by row;
            exactly the tiles the plan does not leave empty.
        kinds: int8 ``(nq, nk)``: the plan's tile map (0 empty: never computed, 1 partial, 2 full).
        live_rows: int32 ``(B, H, nq)``: query rows of each block that see at least one key.
        lse: float32 ``(B, H, L)``: each row's log-sum-exp (-inf on a dead row).
        block: ``(bm, bn)``; ``L``, ``S``, ``B``, ``H``; ``seconds``: the time the pass took.
        labels: optional token strings (length S), shown by the page on hover.
    """

    def __init__(self, req, block, kinds, tiles, mass, live_rows, lse, seconds, mask_name=""):
        self._req = req
        self.block = block
        self.kinds = kinds
        self.tiles = tiles
        self.mass = mass
        self.live_rows = live_rows
        self.lse = lse
        self.seconds = seconds
        self.mask_name = mask_name
        self.labels = None
        B, H, L, S, *_ = req.shape
        self.B, self.H, self.L, self.S = B, H, L, S
        self._row_start = np.searchsorted(tiles[:, 0].numpy(), np.arange(kinds.shape[0] + 1))

    # -- views ---------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        """``(nq, nk)``: the number of query and key blocks."""
        return tuple(self.kinds.shape)

    def dense(self, b: int = 0, head=None, share: bool = False) -> np.ndarray:
        """The ``(nq, nk)`` float64 map of batch row ``b`` and ``head`` (None: the mean over
        heads); ``share=True`` divides each row by its live query rows (rows sum to 1).
        Empty tiles are 0. For small maps (a long input: use ``mass``/``tiles``, or the page)."""
        b, heads = self._check_bh(b, head)
        m = self.mass[b, heads].double().mean(0)
        out = np.zeros(self.shape)
        t = self.tiles.numpy()
        out[t[:, 0], t[:, 1]] = m.numpy()
        if share:
            live = self.live_rows[b, heads].double().mean(0).numpy()
            out = np.divide(out, live[:, None], out=np.zeros_like(out), where=live[:, None] > 0)
        return out

    def top(self, n: int = 5, b: int = 0, head=None, off_diagonal: bool = False):
        """The ``n`` heaviest tiles as ``(mass, share, (q0, q1), (k0, k1))`` token ranges (end
        exclusive), of batch row ``b`` and ``head`` (None: the mean over heads);
        ``off_diagonal=True`` leaves out tiles within two blocks of the diagonal (where local
        attention always lands)."""
        b, heads = self._check_bh(b, head)
        bm, bn = self.block
        m = self.mass[b, heads].double().mean(0)
        live = self.live_rows[b, heads].double().mean(0)
        cand = torch.arange(m.shape[0])
        if off_diagonal:  # left out, never listed (a near tile zeroed and ranked showed as "mass 0" when few were off)
            t = self.tiles
            near = ((t[:, 0] * bm + bm // 2 + (self.S - self.L)) - (t[:, 1] * bn + bn // 2)).abs() < max(bm, bn) * 2
            cand = cand[~near]
        idx = cand[torch.argsort(m[cand], descending=True, stable=True)[:n]]
        res = []
        for i in idx.tolist():
            qb, kb = (int(x) for x in self.tiles[i])
            lv = float(live[qb])
            res.append((float(m[i]), float(m[i]) / lv if lv > 0 else 0.0,
                        (qb * bm, min(self.L, qb * bm + bm)), (kb * bn, min(self.S, kb * bn + bn))))
        return res

    def _check_bh(self, b, head):
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.B:
            raise ValueError(f"b: expected a batch row in 0..{self.B - 1}, got {b!r}.")
        if head is None:
            return b, list(range(self.H))
        if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < self.H:
            raise ValueError(f"head: expected None (mean of heads) or an int in 0..{self.H - 1}, got {head!r}.")
        return b, [head]

    def _check_heads(self, heads) -> list:
        if heads is None:
            return list(range(self.H))
        items = [heads] if isinstance(heads, int) else (
            list(heads) if isinstance(heads, (list, tuple, range)) else None)
        if not items or any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < self.H for h in items):
            raise ValueError(f"heads: expected None (all), an int or a list of ints in 0..{self.H - 1}, got {heads!r}.")
        return items

    # -- exact weights on demand ---------------------------------------------------------------
    def row_weights(self, i: int, b: int = 0, heads=None) -> torch.Tensor:
        """Exact weights of query row ``i`` over all ``S`` keys, ``(H', S)`` (``heads``: None for
        all, an int or a list): the softmax of the row's scores over the keys its plan row leaves
        (0 elsewhere), in the compute dtype. O(S) memory."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.L:
            raise ValueError(f"i: expected a query row in 0..{self.L - 1}, got {i!r}.")
        b, _ = self._check_bh(b, None)
        heads = self._check_heads(heads)
        # only the keys of the tiles the plan leaves its query block: the rest weigh 0
        bm, bn = self.block
        qb = i // bm
        kbs = self.tiles[self._row_start[qb]:self._row_start[qb + 1], 1]
        out = torch.zeros(len(heads), self.S, dtype=self.mass.dtype)
        if kbs.numel():
            j0, j1 = int(kbs[0]) * bn, min(self.S, (int(kbs[-1]) + 1) * bn)
            s = self._scores(b, heads, i, i + 1, j0, j1)  # (1, H', 1, j1 - j0)
            w, _ = _softmax.softmax_lse(s)
            out[:, j0:j1] = w[0, :, 0].to(out.dtype)
        return out

    def tile_weights(self, qb: int, kb: int, b: int = 0, heads=None) -> torch.Tensor:
        """Exact weights inside tile ``(qb, kb)``: ``(H', rows, cols)``, each row normalised by its
        full softmax over all keys (so the tile sums to its ``mass``). The rows' statistics are
        recomputed over the keys their plan leaves (O(bm·S) at most, in runs)."""
        nq, nk = self.shape
        for name, x, n in (("qb", qb, nq), ("kb", kb, nk)):
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < n:
                raise ValueError(f"{name}: expected a block index in 0..{n - 1}, got {x!r}.")
        b, _ = self._check_bh(b, None)
        heads = self._check_heads(heads)
        bm, bn = self.block
        i0, i1 = qb * bm, min(self.L, qb * bm + bm)
        j0, j1 = kb * bn, min(self.S, kb * bn + bn)
        if self.kinds[qb, kb] == EMPTY:
            return torch.zeros(len(heads), i1 - i0, j1 - j0, dtype=self.mass.dtype)
        # row statistics over the live key runs of this query block
        M = l_i = None
        for a, c, _ in _runs_of(self.kinds[qb:qb + 1], self.block, self.S, MAX_RUN)[0]:
            s = self._scores(b, heads, i0, i1, a * bn, min(self.S, c * bn))[0]
            m_r = s.amax(-1)
            if M is None or l_i is None:
                M, l_i = m_r, torch.exp(s - _softmax.guard(m_r)[..., None]).sum(-1)
            else:
                Mn = torch.maximum(M, m_r)
                g = _softmax.guard(Mn)
                l_i = l_i * torch.exp(_softmax.guard(M) - g) + torch.exp(s - g[..., None]).sum(-1)
                M = Mn
        assert M is not None and l_i is not None, "a non-empty tile lies in one of its block's runs"
        s = self._scores(b, heads, i0, i1, j0, j1)[0]
        w = torch.exp(s - _softmax.guard(M)[..., None])
        return torch.where(l_i[..., None] > 0, w / torch.where(l_i > 0, l_i, torch.ones_like(l_i))[..., None],
                           torch.zeros_like(w))

    def _scores(self, b, heads, i0, i1, j0, j1) -> torch.Tensor:
        """Scaled, modified and masked scores ``(1, H', i1 - i0, j1 - j0)`` in the compute dtype."""
        req = self._req
        H, Hkv = req.q.shape[1], req.k.shape[1]
        g = H // Hkv
        cd = req.compute_dtype()
        q = req.q[b:b + 1, heads, i0:i1].to(cd)
        k = req.k[b:b + 1, [h // g for h in heads], j0:j1].to(cd)
        s = torch.matmul(q, k.transpose(-1, -2)) * req.scale
        return modify_scores(req, s, i0, j0, heads=heads, batch=slice(b, b + 1))

    # -- text and pictures ---------------------------------------------------------------------
    def summary(self, top: int = 5) -> str:
        """A few lines: sizes, time, how much of the mass stays near the diagonal, the top tiles."""
        bm, bn = self.block
        nq, nk = self.shape
        T = self.tiles.shape[0]
        live = float(self.live_rows.double().sum())
        rows = self.B * self.H * self.L
        lines = [f"tile mass: B={self.B}, H={self.H}, L={self.L}, S={self.S}, tiles {bm}×{bn} ({nq}×{nk}); "
                 f"{T} of {nq * nk} tiles computed ({100 * T / max(1, nq * nk):.2f}%), {self.seconds:.2f} s"]
        if self.mask_name:
            lines.append(f"mask: {self.mask_name}")
        dead = rows - live
        over = " × ".join(f"{n}={x}" for n, x in (("B", self.B), ("H", self.H)) if x > 1)
        lines.append(f"query rows: {int(live)} live" + (f", {int(dead)} fully masked (weight 0)" if dead else "")
                     + (f" (of {rows} = {over} × L={self.L})" if over else ""))
        t = self.tiles
        qc = t[:, 0].double() * bm + bm / 2
        kc = t[:, 1].double() * bn + bn / 2
        dist = (qc + (self.S - self.L) - kc)  # distance to the diagonal, in tokens
        tot = self.mass.double().sum((0, 1))
        allm = float(tot.sum()) or 1.0
        parts = []
        for lim in sorted({max(bm, bn), 64, 1024, 8192}):
            if lim < self.S:
                parts.append(f"{100 * float(tot[dist.abs() <= lim].sum()) / allm:.1f}% within {lim} tokens")
        if parts:
            lines.append("where the mass goes (all heads): " + ", ".join(parts) + " of the diagonal")
        far = self.top(top, off_diagonal=True) if top else []
        if top:
            lines.append("heaviest tiles away from the diagonal (mean of heads; share = fraction of those query "
                         "rows' attention):" + ("" if far else " none, every tile is within two blocks of it"))
        for m, sh, (q0, q1), (k0, k1) in far:
            lines.append(f"  queries {q0}-{q1 - 1} -> keys {k0}-{k1 - 1}: mass {m:.2f}, share {100 * sh:.1f}%")
        return "\n".join(lines)

    def __repr__(self) -> str:
        bm, bn = self.block
        return (f"TileMass(B={self.B}, H={self.H}, L={self.L}, S={self.S}, block={bm}×{bn}, "
                f"tiles={self.tiles.shape[0]} of {self.shape[0] * self.shape[1]})")

    def to_html(self, path=None, *, title=None, rows=None, max_bytes: int = 4_000_000) -> str:
        """The offline page (one file, no network): a zoomable map of the mass, per head and the
        mean, a hover readout, and exact row weights for ``rows`` (default: a few spread over L).
        Written to ``path`` when given; the HTML text is returned."""
        page = html("tile_mass", self, title=title, rows=rows, max_bytes=max_bytes)
        if page is None:
            raise RuntimeError("TileMass.to_html: no page renderer is registered (attnkit.viz registers one when "
                               "attnkit is imported); import attnkit first.")
        if path is not None:
            from pathlib import Path

            Path(path).write_text(page, encoding="utf-8")
        return page

    def _repr_html_(self) -> str | None:
        return html("tile_mass", self, embed=True, max_bytes=1_500_000)


def run(req, *, block=None, max_run: int = MAX_RUN, workers: int | None = None) -> TileMass:
    """The exact attention mass of every tile of a validated request's ``softmax(q kᵀ · scale)``
    (see the module picture); what :func:`attnkit.tile_mass` runs after checking its arguments.

    Shape legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
    D head dim. ``req.q`` ``(B, H, L, D)``, ``req.k`` ``(B, Hkv, S, D)``; ``block``, ``max_run``,
    ``workers``: as in :func:`attnkit.tile_mass`.
    """
    if isinstance(max_run, bool) or not isinstance(max_run, int) or max_run < 1:
        raise ValueError(f"max_run: expected an int >= 1, got {max_run!r}. Pass e.g. max_run=2048.")
    if workers is None:
        workers = torch.get_num_threads()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected an int >= 1 or None (torch's thread count), got {workers!r}.")
    if req.plan is not None:
        plan = req.plan
        assert isinstance(plan, _plans.BlockPlan), "an explicit plan reaches the request as a BlockPlan"
        if block is not None and _plans._check_block(block) != plan.block:
            raise ValueError(f"block: the plan passed as mask has tiles {plan.block}, got block={block!r}. "
                             "Leave block out (the plan's tiles are used) or build the plan with this block.")
        block = plan.block
    block = _plans._check_block((64, 64) if block is None else block)
    t0 = time.perf_counter()
    with torch.no_grad():
        res = _run(req, block, max_run, workers)
    res.seconds = time.perf_counter() - t0
    res.mask_name = "none" if req.mask is None and req.dense_mask is None and req.bias is None else (
        repr(req.mask) if req.mask is not None else ("bool tensor" if req.dense_mask is not None else "float bias"))
    return res


def _run(req, block, max_run, workers) -> TileMass:
    B, H, L, S, D, _, Hkv = req.shape
    kinds = _live_kinds(req, block)
    nq = kinds.shape[0]
    tiles = torch.nonzero(kinds != EMPTY)  # (T, 2) sorted by query block, then key block
    T = tiles.shape[0]
    od = torch.float64 if req.compute_dtype() == torch.float64 else torch.float32
    mass = torch.zeros(B, H, T, dtype=od)
    live_rows = torch.zeros(B, H, nq, dtype=torch.int32)
    lse = torch.full((B, H, L), float("-inf"), dtype=od)
    all_runs = _runs_of(kinds, block, S, max_run)
    starts = np.searchsorted(tiles[:, 0].numpy(), np.arange(nq + 1))
    out = (mass, live_rows, lse)
    todo = [qb for qb in range(nq) if all_runs[qb]]
    if workers > 1 and len(todo) >= 4 * workers:
        # Query blocks are independent and write disjoint slices: one Python thread per share
        # of them, each running single-threaded torch ops (which release the GIL). Small
        # per-block ops gain little from intra-op threads, and on a busy machine their
        # barriers stall; inter-block parallelism does not.
        from concurrent.futures import ThreadPoolExecutor

        chunks = [todo[w::workers] for w in range(workers)]
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            def share(qbs):
                for qb in qbs:
                    _one_block(req, block, qb, all_runs[qb], int(starts[qb]), out)

            with ThreadPoolExecutor(workers) as ex:
                list(ex.map(share, chunks))  # list(): wait for every share, re-raising its error
        finally:
            torch.set_num_threads(prev)
    else:
        for qb in todo:
            _one_block(req, block, qb, all_runs[qb], int(starts[qb]), out)
    return TileMass(req, block, kinds, tiles, mass, live_rows, lse, 0.0)


def _one_block(req, block, qb, runs, pos, out) -> None:
    """Masses, live rows and lse of query block ``qb`` into its slices of ``out``."""
    mass, live_rows, lse = out
    B, H, L, S, D, _, Hkv = req.shape
    bm, bn = block
    g = H // Hkv
    cd = req.compute_dtype()
    plain = req.score_mod is None and req.bias is None and req.dense_mask is None
    i0, i1 = qb * bm, min(L, qb * bm + bm)
    l_rows = i1 - i0
    # GQA: the g query heads of one kv head are stacked into the GEMM's rows
    qg = req.q[:, :, i0:i1].to(cd).reshape(B, Hkv, g * l_rows, D)
    parts, maxes = [], []
    for a, c, partial in runs:
        j0, j1 = a * bn, min(S, c * bn)
        s = torch.matmul(qg, req.k[:, :, j0:j1].to(cd).transpose(-1, -2))  # (B, Hkv, g·l, n)
        s = s.view(B, H, l_rows, j1 - j0).mul_(req.scale)
        if partial or not plain:
            s = modify_scores(req, s, i0, j0)
        m_r = s.amax(-1)  # (B, H, l)
        p = s.sub_(_softmax.guard(m_r).unsqueeze(-1)).exp_()
        nb = c - a
        pad = nb * bn - (j1 - j0)
        if pad:  # only the last key block can be short
            p = torch.nn.functional.pad(p, (0, pad))
        parts.append(p.view(B, H, l_rows, nb, bn).sum(-1))  # (B, H, l, nb)
        maxes.append(m_r)
    M = maxes[0] if len(maxes) == 1 else torch.stack(maxes).amax(0)
    Mg = _softmax.guard(M)
    if len(parts) == 1:
        sums = parts[0]
    else:  # bring every run to the row's overall max
        sums = torch.cat([p * torch.exp(_softmax.guard(m) - Mg).unsqueeze(-1)
                          for p, m in zip(parts, maxes, strict=True)], -1)  # one max per run
    l_i = sums.sum(-1)  # (B, H, l)
    alive = l_i > 0
    safe = torch.where(alive, l_i, torch.ones_like(l_i))
    w = sums / safe.unsqueeze(-1)  # a dead row: 0 / 1 = 0, never NaN
    n_t = w.shape[-1]
    mass[:, :, pos:pos + n_t] = w.sum(2).to(mass.dtype)
    live_rows[:, :, qb] = alive.sum(-1).to(torch.int32)
    lse[:, :, i0:i1] = torch.where(alive, M + torch.log(safe), torch.full_like(M, float("-inf"))).to(lse.dtype)
