"""The tiled backend's work list: from a tile map to runs of keys, grouped by query block.

The tile map (EMPTY / PARTIAL / FULL per ``bm × bn`` tile; see :mod:`attnkit.plans`)
is collapsed over batch rows and heads (a tile is skipped only if empty for all,
evaluated without a mask only if full for all)::

    causal, L = S = 6, bm = bn = 2          sliding_window(3), same sizes
        k0-1 k2-3 k4-5                          k0-1 k2-3 k4-5
    q0-1   P    .    .                      q0-1   P    .    .
    q2-3   F    P    .                      q2-3   P    P    .
    q4-5   F    F    P                      q4-5   .    P    P

Per query block, the needed key blocks form **runs**: maximal stretches of adjacent
non-empty tiles (capped at ``max_run`` keys), each with the key spans inside it that
need the mask evaluated. One run is one GEMM (or one fused-kernel call). Adjacent
query blocks with identical runs merge into one **group** (a dense or padding mask is
a single group).

Caching contract (why no cached work list can be stale):

* a work list is cached under ``mask.cache_key()`` and the sizes. Built-in masks are
  immutable values (they copy their ids/lengths at construction): the object is the key;
* an opaque ``mask_mod`` (``from_mod``, or any combination containing one) has a key
  only when everything it reads besides its indices is an immutable value (its code,
  and closure / default / global values that are numbers, strings, tuples, modules);
  one that reads a tensor, array, list or object may see new data on the next call (the
  next packed batch's document ids): its tiles are evaluated afresh on every call and
  nothing derived from it is kept — unless the caller passes an explicit
  :class:`~attnkit.plans.BlockPlan` (the visible cache);
* a user bool tensor's tile map lives in the request's ``memo`` (one call): ``auto``'s
  look at the mask and the tiled run share one pass over it, and nothing outlives the call.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .. import _tiling
from .. import masks as _m
from .._tiling import EMPTY, FULL, PARTIAL
from . import _native, _tilebits

__all__ = ["EMPTY", "PARTIAL", "FULL", "WorkList", "tile_map", "dense_kinds", "work_list"]

# (mask.cache_key(), sizes, options) -> WorkList; least recently used entries are dropped
_CACHE: OrderedDict = OrderedDict()
_CACHE_MAX = 256


@dataclass(frozen=True)
class WorkList:
    """``groups = ((i0, i1, runs), ...)`` with ``runs = ((j0, j1, ((a, b), ...)), ...)``.

    Query rows ``[i0, i1)`` are one or more adjacent query blocks whose runs are
    identical; keys ``[j0, j1)`` form one GEMM; the spans ``[a, b)`` inside it are the
    partial tiles where the mask must be evaluated. ``density``: fraction of tiles computed.
    """

    bm: int
    bn: int
    groups: tuple
    density: float


def dense_kinds(dense_mask: torch.Tensor, L, S, bm, bn, memo: dict | None = None) -> torch.Tensor:
    """``(nq, nk)`` kinds of a user bool tensor broadcastable to (B, H, L, S), reduced per tile
    (no copy to L×S). ``memo`` is the request's per-call dict (see the caching contract)."""
    key = ("dense_kinds", L, S, bm, bn)
    if memo is not None and key in memo:
        return memo[key]
    if (bm, bn) == (_tilebits.TILE, _tilebits.TILE) and dense_mask.dtype is torch.bool and dense_mask.is_cpu \
            and _native.dense_tiles_fn() is not None:  # the kernel's tile map, read in C, kept for the kernel
        grid = _tiling.collapse(_tilebits.dense_bits(dense_mask, L, S, memo).kinds)
        if memo is not None:
            memo[key] = grid
        return grid
    k = _tiling.reduce_allowed(dense_mask, bm, bn)
    nq, nk = -(-L // bm), -(-S // bn)
    grid = _tiling.collapse(k.expand(k.shape[0], k.shape[1], nq, nk))
    if memo is not None:
        memo[key] = grid
    return grid


def tile_map(mask: _m.Mask | None, B, H, L, S, bm, bn) -> torch.Tensor:
    """``(nq, nk)`` kinds of a structured mask, collapsed over (batch, head)."""
    if mask is None:
        return torch.full((-(-L // bm), -(-S // bn)), FULL, dtype=torch.int8)
    k = mask.tile_kinds(B, H, L, S, bm, bn)
    return _tiling.collapse(k.expand(k.shape[0], k.shape[1], -(-L // bm), -(-S // bn)))


def _runs_from_grid(grid: torch.Tensor, S, bn, max_run_blocks) -> tuple:
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
                    spans: list[tuple[int, int]] = []
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
    groups: list[tuple[int, int, tuple]] = []
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


def work_list(mask: _m.Mask | None, dense_mask: torch.Tensor | None, B, H, L, S, bm, bn, max_run,
              max_group_elems: int = 0, count_all: bool = True, memo: dict | None = None,
              given: torch.Tensor | None = None) -> WorkList:
    """The work list for this mask (and optional dense bool mask) at these sizes.

    ``given``: ``(nq, nk)`` kinds the caller already holds (an explicit BlockPlan) — used
    instead of planning ``mask`` again. Runs are capped at ``max_run`` keys; adjacent
    query blocks with identical runs merge while rows × run keys <= ``max_group_elems``.
    """
    max_run_blocks = max(1, -(-max_run // bn))
    key = None
    if dense_mask is None and given is None and mask is not None:
        mk = mask.cache_key()
        key = None if mk is None else (mk, B, H, L, S, bm, bn, max_run_blocks, max_group_elems, count_all)
    if key is not None:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    grid = given if given is not None else tile_map(mask, B, H, L, S, bm, bn)
    if dense_mask is not None:
        grid = torch.minimum(grid, dense_kinds(dense_mask, L, S, bm, bn, memo))
    runs = _runs_from_grid(grid, S, bn, max_run_blocks)
    wl = WorkList(bm, bn, _group(runs, L, bm, max_group_elems, count_all),
                  float((grid > 0).float().mean()) if grid.numel() else 0.0)
    if key is not None:
        _CACHE[key] = wl
        if len(_CACHE) > _CACHE_MAX:
            _CACHE.popitem(last=False)
    return wl
