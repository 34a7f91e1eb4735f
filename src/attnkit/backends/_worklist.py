"""Block summary of a mask for the tiled backend: which tiles are empty, full or partial.

The scores ``(L, S)`` are cut into tiles of ``bm`` query rows × ``bn`` key columns.
Each tile gets one state, conservative over every batch row and head::

    EMPTY   (0)  no (b, h, i, j) in the tile attends      -> skipped
    PARTIAL (1)  some do, some may not                    -> mask_mod evaluated on the tile
    FULL    (2)  every (b, h, i, j) in the tile attends   -> no mask evaluation

    causal, L = S = 6, bm = bn = 2          sliding_window(3), same sizes
        k0-1 k2-3 k4-5                          k0-1 k2-3 k4-5
    q0-1   P    .    .                      q0-1   P    .    .
    q2-3   F    P    .                      q2-3   P    P    .
    q4-5   F    F    P                      q4-5   .    P    P

No L×S tensor is ever built. Built-in masks give their grid in closed form from
the tile corners (interval arithmetic on the first/last row and column of each
tile). Combinations map onto the lattice EMPTY < PARTIAL < FULL: ``&`` is the
elementwise min, ``|`` the max, ``~`` swaps EMPTY and FULL. A user ``mask_mod`` of
unknown structure is evaluated on chunks of whole query blocks (never L×S at
once). The grid itself is ``ceil(L/bm) × ceil(S/bn)`` int8, like FlexAttention's
BlockMask.

Caching contract (why no cached plan can be stale):

* a plan is cached per **mask object** only when ``mask.cacheable``: built-in masks
  are immutable values (they copy their ids/lengths at construction), so the same
  object at the same sizes always has the same plan;
* an opaque ``mask_mod`` (``from_mod``, or any combination containing one) may read
  data that changes between calls (the next packed batch's document ids): it is
  evaluated afresh on every call and nothing derived from it is kept;
* a user bool tensor's summary lives in the request's ``memo`` (one call): ``auto``'s
  look at the mask and the tiled run share one pass over it, and nothing outlives the call.

``plan(...)`` turns the grid into, per query block, a list of **runs**: maximal
stretches of adjacent needed key blocks (capped at ``max_run`` keys), each with the
key spans inside it that need the mask evaluated. One run is one GEMM (or one
fused-kernel call). Adjacent query blocks with identical runs are merged into one
**group** (a dense or padding mask is a single group).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .. import masks as _m

__all__ = ["EMPTY", "PARTIAL", "FULL", "Plan", "block_grid", "dense_grid", "plan"]

EMPTY, PARTIAL, FULL = 0, 1, 2

# Chunk of query rows evaluated at once for a user mask_mod: ~ this many elements per chunk.
_EVAL_ELEMS = 1 << 22

# mask object (cacheable only) -> {sizes: Plan}; dies with the mask object
_PLAN_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Plan:
    """Work list: ``groups = ((i0, i1, runs), ...)`` with ``runs = ((j0, j1, ((a, b), ...)), ...)``.

    Query rows ``[i0, i1)`` are one or more adjacent query blocks whose runs are
    identical (a dense or padding mask is one group); keys ``[j0, j1)`` form one
    GEMM; the spans ``[a, b)`` inside it are the partial tiles where the mask must
    be evaluated. ``density`` is the fraction of tiles computed (for FLOP counts).
    """

    bm: int
    bn: int
    groups: tuple
    density: float


def _edges(n: int, blk: int):
    lo = torch.arange(0, n, blk)
    hi = torch.clamp(lo + blk, max=n) - 1  # inclusive last index of each block
    return lo, hi


def _grid_from(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    g = torch.full(full.shape, PARTIAL, dtype=torch.int8)
    g[full] = FULL
    g[empty] = EMPTY
    return g


def _causal_grid(off, w, qlo, qhi, klo, khi):
    """Query row i (key position p = i + off) sees keys p - w < j <= p (w=None: no lower bound)."""
    full = khi[None, :] <= qlo[:, None] + off
    empty = klo[None, :] > qhi[:, None] + off
    if w is not None:
        full &= klo[None, :] > qhi[:, None] + off - w
        empty |= khi[None, :] <= qlo[:, None] + off - w
    return _grid_from(full, empty)


def _keys_below(lo_len: int, hi_len: int, nq: int, klo, khi):
    """Keys j < length, where the length is between lo_len and hi_len over the batch."""
    full = (khi < lo_len)[None, :].expand(nq, -1)
    empty = (klo >= hi_len)[None, :].expand(nq, -1)
    return _grid_from(full, empty)


def _block_minmax(x: torch.Tensor, blk: int):
    """Per-block min and max over the last dim of ``x (R, n)`` (and over R)."""
    n = x.shape[-1]
    pad = (-n) % blk
    if pad:
        x = torch.cat([x, x[..., -1:].expand(x.shape[0], pad)], dim=-1)
    x = x.reshape(x.shape[0], -1, blk)
    return x.amin(dim=(0, 2)), x.amax(dim=(0, 2))


def _document_grid(mask: _m.Document, L, S, bm, bn):
    ids = mask._ids2d()  # (B or 1, S)
    off = S - L
    qmin, qmax = _block_minmax(ids[:, off:off + L], bm)
    kmin, kmax = _block_minmax(ids, bn)
    empty = (qmax[:, None] < kmin[None, :]) | (qmin[:, None] > kmax[None, :])
    full = (qmin == qmax)[:, None] & (kmin == kmax)[None, :] & (qmin[:, None] == kmin[None, :])
    return _grid_from(full, empty)


def _reduce_blocks(x: torch.Tensor, blk: int, dim: int, op: str) -> torch.Tensor:
    """any/all over blocks of ``blk`` along ``dim`` of a bool tensor (a size-1 dim stays 1)."""
    n = x.shape[dim]
    if n == 1:
        return x
    pad = (-n) % blk
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, torch.full(shape, op == "all", dtype=torch.bool)], dim=dim)
    shape = list(x.shape)
    shape[dim:dim + 1] = [shape[dim] // blk, blk]
    x = x.reshape(shape)
    return x.any(dim=dim + 1) if op == "any" else x.all(dim=dim + 1)


def _from_evaluated(allowed_rows, bm, bn):
    """Grid rows from an evaluated bool block of query rows, reduced over (b, h)."""
    a = allowed_rows.reshape(-1, *allowed_rows.shape[-2:])
    any_ = _reduce_blocks(_reduce_blocks(a.any(dim=0), bm, 0, "any"), bn, 1, "any")
    all_ = _reduce_blocks(_reduce_blocks(a.all(dim=0), bm, 0, "all"), bn, 1, "all")
    return any_, all_


def _frommod_grid(mask: _m.Mask, B, H, L, S, bm, bn):
    """Evaluate an opaque mask_mod on chunks of whole query blocks (afresh on every call:
    the data it reads may have changed since the last one)."""
    mod = mask.bind(L, S)
    nq, nk = -(-L // bm), -(-S // bn)
    rows = max(bm, (_EVAL_ELEMS // max(S, 1)) // bm * bm)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    kv = torch.arange(S).view(1, 1, 1, S)
    anys, alls = [], []
    for r0 in range(0, L, rows):
        r1 = min(L, r0 + rows)
        q = torch.arange(r0, r1).view(1, 1, -1, 1)
        allowed = mod(b, h, q, kv)
        if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
            raise TypeError(f"mask_mod of {mask!r} must return a bool tensor, got {type(allowed).__name__}.")
        allowed = allowed.expand(*allowed.shape[:-2], r1 - r0, S)
        a, f = _from_evaluated(allowed, bm, bn)
        anys.append(a.expand(-1, nk))
        alls.append(f.expand(-1, nk))
    any_, all_ = torch.cat(anys), torch.cat(alls)
    return _grid_from(all_, ~any_)


def block_grid(mask: _m.Mask | None, B, H, L, S, bm, bn) -> torch.Tensor:
    """``(ceil(L/bm), ceil(S/bn))`` int8 grid of EMPTY / PARTIAL / FULL for a structured mask."""
    nq, nk = -(-L // bm), -(-S // bn)
    qlo, qhi = _edges(L, bm)
    klo, khi = _edges(S, bn)
    if mask is None or isinstance(mask, _m.Full):
        return torch.full((nq, nk), FULL, dtype=torch.int8)
    if isinstance(mask, _m.Causal):
        return _causal_grid(_m._offset(mask.align, L, S), None, qlo, qhi, klo, khi)
    if isinstance(mask, _m.SlidingWindow):
        return _causal_grid(_m._offset(mask.align, L, S), mask.size, qlo, qhi, klo, khi)
    if isinstance(mask, _m.PrefixLM):
        p = mask.prefix_length
        return torch.maximum(_keys_below(p, p, nq, klo, khi), _causal_grid(S - L, None, qlo, qhi, klo, khi))
    if isinstance(mask, _m.Padding):
        lens = mask.key_lengths
        return _keys_below(int(lens.min()), int(lens.max()), nq, klo, khi)
    if isinstance(mask, _m.Document):
        return _document_grid(mask, L, S, bm, bn)
    if isinstance(mask, _m.And):
        grids = [block_grid(p, B, H, L, S, bm, bn) for p in mask.parts]
        return torch.stack(grids).amin(dim=0)
    if isinstance(mask, _m.Not):
        return (FULL - block_grid(mask.inner, B, H, L, S, bm, bn)).to(torch.int8)
    if isinstance(mask, _m.Or):
        grids = [block_grid(p, B, H, L, S, bm, bn) for p in mask.parts]
        return torch.stack(grids).amax(dim=0)
    return _frommod_grid(mask, B, H, L, S, bm, bn)  # FromMod or any Mask of unknown structure


def dense_grid(dense_mask: torch.Tensor, L, S, bm, bn, memo: dict | None = None) -> torch.Tensor:
    """Grid of a user bool tensor broadcastable to (B, H, L, S): reduced per tile, no copy to L×S.

    ``memo`` is the request's per-call dict, so ``auto``'s look at the mask and the tiled
    run share one pass over it; nothing is kept across calls (the tensor may change).
    """
    key = ("dense_grid", L, S, bm, bn)
    if memo is not None and key in memo:
        return memo[key]
    any_, all_ = _from_evaluated(dense_mask, bm, bn)
    nq, nk = -(-L // bm), -(-S // bn)
    grid = _grid_from(all_.expand(nq, nk).cpu(), ~any_.expand(nq, nk).cpu())
    if memo is not None:
        memo[key] = grid
    return grid


def _runs_from_grid(grid: torch.Tensor, L, S, bm, bn, max_run_blocks) -> tuple:
    g = grid.numpy()
    out = []
    for qi in range(g.shape[0]):
        row = g[qi]
        need = np.flatnonzero(row)
        runs = []
        if need.size:
            breaks = np.flatnonzero(np.diff(need) != 1) + 1
            for seg in np.split(need, breaks):
                for c0 in range(0, seg.size, max_run_blocks):
                    blocks = seg[c0:c0 + max_run_blocks]
                    j0, j1 = int(blocks[0]) * bn, min(S, (int(blocks[-1]) + 1) * bn)
                    spans = []
                    for kb in blocks[row[blocks] == PARTIAL]:
                        a, b = int(kb) * bn, min(S, (int(kb) + 1) * bn)
                        if spans and spans[-1][1] == a:  # merge adjacent partial tiles
                            spans[-1] = (spans[-1][0], b)
                        else:
                            spans.append((a, b))
                    runs.append((j0, j1, tuple(spans)))
        out.append(tuple(runs))
    return tuple(out)


def _group(runs_per_block, L, bm, max_elems, count_all):
    """Merge adjacent query blocks with identical runs while rows × keys stays <= max_elems.

    ``count_all=False`` counts only the keys of runs with partial tiles (the fused
    worker builds a mask tile only for those).
    """
    groups = []
    for qi, runs in enumerate(runs_per_block):
        i0, i1 = qi * bm, min(L, (qi + 1) * bm)
        if not runs:
            continue
        if groups and groups[-1][2] == runs and groups[-1][1] == i0:
            width = max([j1 - j0 for j0, j1, sp in runs if count_all or sp], default=0)
            if (i1 - groups[-1][0]) * width <= max_elems:
                groups[-1] = (groups[-1][0], i1, runs)
                continue
        groups.append((i0, i1, runs))
    return tuple(groups)


def plan(mask: _m.Mask | None, dense_mask: torch.Tensor | None, B, H, L, S, bm, bn, max_run,
         max_group_elems: int = 0, count_all: bool = True, memo: dict | None = None) -> Plan:
    """The work list for this mask (and optional dense bool mask) at these sizes.

    Runs are capped at ``max_run`` keys; adjacent query blocks with identical runs
    are merged while rows × run keys <= ``max_group_elems`` (0: no merging).
    """
    max_run_blocks = max(1, -(-max_run // bn))
    key = (B, H, L, S, bm, bn, max_run_blocks, max_group_elems, count_all)
    cacheable = dense_mask is None and mask is not None and mask.cacheable
    if cacheable:
        hit = _PLAN_CACHE.get(mask, {}).get(key)
        if hit is not None:
            return hit
    grid = block_grid(mask, B, H, L, S, bm, bn)
    if dense_mask is not None:
        grid = torch.minimum(grid, dense_grid(dense_mask, L, S, bm, bn, memo))
    runs = _runs_from_grid(grid, L, S, bm, bn, max_run_blocks)
    p = Plan(bm, bn, _group(runs, L, bm, max_group_elems, count_all),
             float((grid > 0).float().mean()) if grid.numel() else 0.0)
    if cacheable:
        _PLAN_CACHE.setdefault(mask, {})[key] = p
    return p
