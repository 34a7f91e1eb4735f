"""The schedule: which (query rank, key rank) pairs hold a visible tile, and the blocks of each pair."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import masks as _masks
from .. import plans as _plans
from .._tiling import EMPTY
from .layouts import Layout


@dataclass
class Schedule:
    """Which (query rank r, key rank s) pairs hold a visible tile, from the plan at the layout's units.

    ``visible (W, W)`` bool; ``full (W, W)``: every tile of the pair is full (no mask needed);
    ``tiles (W, W)`` non-empty tiles; ``empty (W, W)`` empty tiles. ``send_to[s]``: the ranks
    that need s's K/V; ``recv_from[r]``: the ranks whose K/V r needs (both without r itself).
    """
    layout: Layout
    visible: torch.Tensor
    full: torch.Tensor
    tiles: torch.Tensor
    empty: torch.Tensor
    send_to: list = field(default_factory=list)
    recv_from: list = field(default_factory=list)
    unit_live: torch.Tensor | None = None  # (n, n) units
    unit_full: torch.Tensor | None = None
    pure_causal: bool = False
    _blocks: dict = field(default_factory=dict, repr=False)

    #: above this many (query run × key run) blocks a pair is computed as one block
    MAX_BLOCKS = 64

    def span(self, r: int, s: int) -> tuple[int, int]:
        """The rows ``[a, b)`` of rank s's shard that rank r's blocks read (what travels from s to r;
        (0, 0) when none): a window's neighbour sends its last ``window`` keys, not its shard."""
        bl = self.blocks(r, s)
        if not bl:
            return 0, 0
        return min(x[2] for x in bl), max(x[3] for x in bl)

    def blocks(self, r: int, s: int, shift: bool = False) -> list:
        """The blocks of pair (r, s), in order: ``(qa, qb, ka, kb, kind)`` with local row ranges of
        r's queries and s's keys (one per pair of runs of consecutive units that holds a visible
        tile) and ``kind`` "full" (no mask), "causal" (a run against itself under a causal mask:
        plain ``causal=True``) or "mask" (the global mask at those positions)."""
        if shift:  # key rows counted from the start of span(r, s): the rows that travelled
            a = self.span(r, s)[0]
            return [(qa, qb, ka - a, kb - a, kind) for qa, qb, ka, kb, kind in self.blocks(r, s)]
        key = (r, s)
        if key in self._blocks:
            return self._blocks[key]
        lay = self.layout
        out = []
        live, full = self.unit_live, self.unit_full
        assert live is not None and full is not None, "schedule() builds the unit maps"
        if bool(self.visible[r, s]):
            runs_r, runs_s = lay.runs[r], lay.runs[s]
            if len(runs_r) * len(runs_s) > self.MAX_BLOCKS:
                kind = "full" if bool(self.full[r, s]) else ("causal" if self.pure_causal and r == s else "mask")
                out = [(0, lay.lengths[r], 0, lay.lengths[s], kind)]
            else:
                for qa, qb, ua, ub in runs_r:
                    for ka, kb, va, vb in runs_s:
                        if not bool(live[ua:ub, va:vb].any()):
                            continue
                        if bool(full[ua:ub, va:vb].all()):
                            kind = "full"
                        elif self.pure_causal and r == s and (ua, ub) == (va, vb):
                            kind = "causal"
                        else:
                            out += self._mask_blocks(qa, qb, ua, ub, ka, kb, va, vb)
                            continue
                        out.append((qa, qb, ka, kb, kind))
        self._blocks[key] = out
        return out

    #: a masked block is cut into pieces of at most this many query positions (memory: a piece's
    #: recomputation in the backward, not a shard's)
    MASK_ROWS = 4096

    def _mask_blocks(self, qa, qb, ua, ub, ka, kb, va, vb) -> list:
        """The masked block (query rows qa:qb = units ua:ub) × (keys ka:kb = units va:vb), cut into pieces
        of at most :attr:`MASK_ROWS` query positions, each trimmed to the units that see something: a
        window's pair with the previous rank is its first ``window`` queries × last ``window`` keys,
        not two whole shards; its own pair a band of pieces, each against the keys of its band."""
        live, b = self.unit_live, self.layout.block
        assert live is not None
        step = max(1, self.MASK_ROWS // b)
        out = []
        for u in range(ua, ub, step):
            blk = live[u:min(ub, u + step), va:vb]
            rows = torch.nonzero(blk.any(1)).flatten()
            if rows.numel() == 0:
                continue
            cols = torch.nonzero(blk.any(0)).flatten()
            u0, u1 = u + int(rows[0]), u + int(rows[-1]) + 1
            v0, v1 = va + int(cols[0]), va + int(cols[-1]) + 1
            out.append((qa + (u0 - ua) * b, min(qb, qa + (u1 - ua) * b), ka + (v0 - va) * b,
                        min(kb, ka + (v1 - va) * b), "mask"))
        return out

    def row_blocks(self, r: int) -> dict:
        """``{s: blocks(r, s)}`` for every key rank s."""
        return {s: self.blocks(r, s) for s in range(self.layout.W)}

    def rounds(self) -> list[int]:
        """The streaming rounds d (1 ≤ d < W) in which some rank r needs rank (r − d) mod W's keys;
        the others are skipped by every rank (a window under a contiguous layout: round 1 only)."""
        W = self.layout.W
        return [d for d in range(1, W) if any(bool(self.visible[(s + d) % W, s]) for s in range(W))]

    def held(self, keep_kv=False) -> int:
        """On paper: the most received K/V shards any rank holds at once under ``comm="p2p"`` (the one
        computed on and the next in flight; with ``keep_kv`` the kept ones too — ``"auto"`` keeps
        only a single peer's)."""
        W, most = self.layout.W, 0
        for r in range(W):
            n = len(self.recv_from[r])
            keep = n <= 1 if keep_kv == "auto" else bool(keep_kv)
            most = max(most, n if keep else min(n, 2))
        return most


def schedule(lay: Layout, mask, *, B: int | None = None, H: int | None = None) -> Schedule:
    """The :class:`Schedule` of ``mask`` (None: full attention) under ``lay``."""
    W, L, blk = lay.W, lay.L, lay.block
    n = -(-L // blk)
    if mask is None:
        kinds = torch.full((1, 1, n, n), 2, dtype=torch.int8)
    else:
        kinds = _plans.plan(mask, L, L, B=B, H=H, block=blk).kinds
    live = (kinds != EMPTY).any(dim=1).any(dim=0)  # (n, n): non-empty for some batch row / head
    full = (kinds == 2).all(dim=1).all(dim=0)
    own = torch.zeros(W, n, dtype=torch.float64)
    for r, us in enumerate(lay.units):
        own[r, us] = 1.0
    tiles = (own @ live.double() @ own.T).round().long()  # (W, W) non-empty tiles per rank pair
    total = own.sum(1)[:, None] * own.sum(1)[None, :]
    empty = (total - tiles.double()).round().long()
    vis = tiles > 0
    allfull = ((own @ (~full).double() @ own.T) == 0) & vis
    send_to = [[t for t in range(W) if t != s and vis[t, s]] for s in range(W)]
    recv_from = [[s for s in range(W) if s != r and vis[r, s]] for r in range(W)]
    return Schedule(lay, vis, allfull, tiles, empty, send_to, recv_from, live, full,
                    isinstance(mask, _masks.Causal))


def _plan_B(mask, B):
    return None if mask is None else (mask.batch_size or (B if _needs_bh(mask) else None))


def _plan_H(mask, H):
    return H if mask is not None and _needs_bh(mask) else None


def _needs_bh(mask) -> bool:
    """Whether the tile map may depend on the batch row / head (``Mask.same_for_every_head`` False: a mask_mod, a
    user's subclass, a BlockMask read as a mask). A wrong False plans every head by head 0's tiles and hands other
    heads head 0's pattern: a silent wrong answer."""
    return not mask.same_for_every_head
