"""Any mask as attnkit's compiled kernel runs it: 64 × 64 tiles, each empty, full, or partial with its own bits.

The tile kinds are the block plan's (:meth:`attnkit.masks.Mask.tile_kinds`: closed form for built-in
masks, range evaluation for a ``mask_mod``, points only where ranges cannot decide). The mask of each
partial tile is then evaluated once at its 64 × 64 points, all partial tiles stacked in a few calls, and
kept as 64 rows × 64 bits (two 32-bit planes), so the kernel masks a partial tile with a shift and an
``and`` per score and never calls Python::

    kinds (nq × nk)         partial tile (2, 1): one word pair per query row
      k0 k1 k2                  keys 0..31   keys 32..63
    q0 P  .  .              r0  0b…0001      0b…0000        bit j set: row attends key j
    q1 F  P  .              r1  0b…0011      0b…0000
    q2 F  P  P              …

Shapes: ``kinds`` int8 ``(TB, TH, nq, nk)`` (``TB ∈ {1, B}``, ``TH ∈ {1, H}``, as the mask depends on
the batch row / head), ``index`` int32 of the same shape (a partial tile's row in ``bits``, -1
elsewhere), ``bits`` int32 ``(P, 2, 64)``.

Caching (content, never identity): a map is kept under ``mask.cache_key()`` and the sizes. Built-in
masks are immutable values; a ``mask_mod`` has a key when everything it reads is an immutable value
or a CPU tensor / array, keyed by a digest of its bytes taken on every call
(:func:`attnkit._mods.value_key`): the next batch's document ids, or ids edited in place, give a new
key; a mod reading anything else (a list, an object's attribute) is evaluated afresh on every call.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .. import _mods, _tiling
from .. import masks as _m
from .._tiling import FULL, PARTIAL, host_array
from . import _native

__all__ = ["TileBits", "TILE", "tile_bits", "plan_bits", "dense_bits", "unpack"]

TILE = 64  # the kernel's tile (BM = BN in csrc/attn_impl.h)
# Points per evaluation call of the mask on stacked partial tiles (bounds the bool temporaries).
_POINTS_PER_CALL = 1 << 22
_CACHE: OrderedDict = OrderedDict()
_CACHE_MAX = 16


@dataclass(frozen=True)
class TileBits:
    """A mask's tile map for the kernel (see the module docstring for the shapes)."""

    kinds: torch.Tensor
    index: torch.Tensor
    bits: torch.Tensor

    @property
    def partial_tiles(self) -> int:
        return int(self.bits.shape[0])

    @property
    def computed_fraction(self) -> float:
        k = self.kinds
        return float((k != 0).float().mean()) if k.numel() else 0.0


def tile_bits(mask: _m.Mask, B: int, H: int, L: int, S: int) -> TileBits:
    """The kernel's tile map of ``mask`` for a call of these sizes (cached by content where the mask has a key).
    Raises whatever the mask's own evaluation raises (the caller then keeps the call off the kernel)."""
    key = mask.cache_key()
    if key is not None:
        key = (key, B, H, L, S)
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    tb = _with_bits(mask.tile_kinds(B, H, L, S, TILE, TILE), mask, B, H, L, S)
    _keep(key, tb)
    return tb


def plan_bits(plan, extra: _m.Mask | None, B: int, H: int, L: int, S: int) -> TileBits:
    """The tile map of an explicit :class:`~attnkit.plans.BlockPlan` (a FlexAttention ``BlockMask``'s tiles):
    its own kinds, as given (a full tile is attended whole, an empty one skipped, as FlexAttention's kernels
    read a BlockMask), each cut into 64 × 64 tiles; the mask evaluated in the partial ones. ``extra``: a
    mask on top (``causal=True``), intersected. The plan's tiles must be multiples of 64."""
    bm, bn = plan.block
    assert bm % TILE == 0 and bn % TILE == 0, plan.block
    mkey, ekey = plan.mask.cache_key(), (None if extra is None else extra.cache_key())
    kinds = plan.kinds
    key = None
    if mkey is not None and (extra is None or ekey is not None):
        key = ("plan", mkey, ekey, _mods._content(kinds), plan.block, B, H, L, S)
        hit = _CACHE.get(key) if key[3] is not None else None
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    nq, nk = -(-L // TILE), -(-S // TILE)
    k64 = kinds.repeat_interleave(bm // TILE, 2).repeat_interleave(bn // TILE, 3)[:, :, :nq, :nk]
    mask = plan.mask
    # without an extra mask the points evaluated below all lie in the plan's partial tiles: a BlockMask's own mod
    # decides them there (no per-point lookup of its block kinds); no mod: a partial tile is attended whole. (With
    # one, a tile can be partial by the extra mask inside a full block, where the mod does not apply.)
    within = getattr(mask, "within_partial", None)
    if within is not None and extra is None:
        mask = within() or _m.Full()
    # A plan whose tiles were made for one batch row / head (a BlockMask built with B=None / H=None) over a mod that
    # reads b / h: the partial tiles' points are that mod's at each row and head (FlexAttention's kernels call it
    # with the real b, h inside a partial block), so the map holds a tile per row / head, not row 0's / head 0's
    Bp, Hp = 1, 1
    if (k64.shape[0] < B or k64.shape[1] < H) and not isinstance(mask, _m.Full):
        Bp, Hp = _m.lead_shape(mask.points_mod(B, H, L, S), B, H, L, S)
    if Bp > k64.shape[0] or Hp > k64.shape[1]:
        k64 = k64.expand(max(Bp, k64.shape[0]), max(Hp, k64.shape[1]), nq, nk)
    if extra is not None:
        ek = extra.tile_kinds(B, H, L, S, TILE, TILE)
        shape = torch.broadcast_shapes(k64.shape, ek.shape)
        k64, mask = torch.minimum(k64.expand(shape), ek.expand(shape)), mask & extra
    tb = _with_bits(k64, mask, B, H, L, S)
    if key is not None and key[3] is not None:
        _keep(key, tb)
    return tb


def dense_bits(dense: torch.Tensor, L: int, S: int, memo: dict | None = None) -> TileBits:
    """The tile map of a user's bool tensor mask (4-D, broadcastable to ``(B, H, L, S)``, True = attend), read off
    its values: kinds ``(TB, TH, nq, nk)`` with ``TB``, ``TH`` its own batch and head dims (1 where it broadcasts),
    each partial tile's bits packed as :func:`tile_bits`'. Read in one pass over the mask's bytes by the kernel's C
    pass where it is built (``_native.dense_tiles_fn``: 0.8-0.9 ms at L = S = 2048 against 4-35 ms by torch ops,
    Intel Xeon, ``benchmarks/mask_read.py``), its map kept in the call's ``memo`` (``auto``'s route reads its kinds:
    :func:`_worklist.dense_kinds`). Not cached across calls: each call reads the mask it is given (an in-place edit
    is always seen). Without the C pass, torch ops; where ``auto``'s route already reduced this call's mask to
    64 × 64 kinds (``memo``, one batch row and head), they are reused, and only the partial tiles are read again."""
    TB, TH = dense.shape[0], dense.shape[1]
    dense = dense.cpu()
    nq, nk = -(-L // TILE), -(-S // TILE)
    read = _native.dense_tiles_fn() if dense.dtype is torch.bool and dense.layout is torch.strided else None
    if read is not None:  # one pass over its bytes in C (kept in the call's memo: the route's summary reads it too)
        key = ("dense_bits", L, S)
        tb = None if memo is None else memo.get(key)
        if tb is None:
            tb = _read_dense(read, dense, L, S)
            if memo is not None:
                memo[key] = tb
        return tb
    a = dense.expand(TB, TH, L, S)
    summary = None if memo is None or TB != 1 or TH != 1 else memo.get(("dense_kinds", L, S, TILE, TILE))
    if summary is not None and tuple(summary.shape) == (nq, nk):
        kinds = summary.to(torch.int8).reshape(1, 1, nq, nk).contiguous()
    else:  # (a size-1 row or key dim reduced as it is, then broadcast; ragged edges: only what exists decides)
        kinds = _tiling.reduce_allowed(dense, TILE, TILE).to(torch.int8).expand(TB, TH, nq, nk).contiguous()
    partial = (kinds == PARTIAL).nonzero()  # (P, 4): (b, h, query block, key block)
    index = torch.full(kinds.shape, -1, dtype=torch.int32)
    index[tuple(partial.t())] = torch.arange(partial.shape[0], dtype=torch.int32)
    if partial.shape[0]:
        # the partial tiles' points gathered from the (broadcast) mask, P x 64 x 64 — never a copy of all L x S (a
        # key padding mask (B, 1, 1, S) stays S wide); rows past L repeat row L - 1 (never read, as _bits'), keys
        # past S are cleared
        P = partial.shape[0]
        ar = torch.arange(TILE)
        rows = (partial[:, 2:3] * TILE + ar).clamp(max=L - 1).view(P, TILE, 1)
        cols_raw = partial[:, 3:4] * TILE + ar
        cols = cols_raw.clamp(max=S - 1).view(P, 1, TILE)
        picked = a[partial[:, 0].view(P, 1, 1), partial[:, 1].view(P, 1, 1), rows, cols]  # (P, rows, keys)
        picked &= (cols_raw < S).view(P, 1, TILE)
        bits = _words(picked)
    else:
        bits = torch.zeros(0, 2, TILE, dtype=torch.int32)
    return TileBits(kinds, index, bits)


def _read_dense(read, dense: torch.Tensor, L: int, S: int) -> TileBits:
    """:func:`dense_bits` by the kernel's C pass (``_native.dense_tiles_fn``): room for every tile's bits where that
    is small, else for a quarter of them, and once more with room for all P where a mask has more partial tiles."""
    TB, TH = dense.shape[0], dense.shape[1]
    nq, nk = -(-L // TILE), -(-S // TILE)
    n = TB * TH * nq * nk
    kinds = torch.empty(TB, TH, nq, nk, dtype=torch.int8)
    index = torch.empty(TB, TH, nq, nk, dtype=torch.int32)
    bits = torch.empty(n if n <= _ROOM_ALL_TILES else n // 4, 2, TILE, dtype=torch.int32)
    P = read(dense, L, S, kinds, index, bits)
    if P > bits.shape[0]:
        bits = torch.empty(P, 2, TILE, dtype=torch.int32)
        read(dense, L, S, kinds, index, bits)
    return TileBits(kinds, index, bits[:P].clone() if bits.shape[0] > 2 * P else bits[:P])


# the C pass's first try has room for every tile's bits up to this many tiles (512 B a tile: 2 MB)
_ROOM_ALL_TILES = 4096


def _with_bits(kinds: torch.Tensor, mask: _m.Mask, B: int, H: int, L: int, S: int) -> TileBits:
    kinds = kinds.contiguous()
    partial = (kinds == PARTIAL).nonzero()  # (P, 4): (b, h, query block, key block)
    index = torch.full(kinds.shape, -1, dtype=torch.int32)
    index[tuple(partial.t())] = torch.arange(partial.shape[0], dtype=torch.int32)
    return TileBits(kinds, index, _bits(mask.points_mod(B, H, L, S), partial, L, S))


def _keep(key, tb: TileBits) -> None:
    if key is not None:
        _CACHE[key] = tb
        if len(_CACHE) > _CACHE_MAX:
            _CACHE.popitem(last=False)


def _bits(fn, tiles: torch.Tensor, L: int, S: int) -> torch.Tensor:
    """int32 ``(P, 2, 64)``: the points of each tile ``(b, h, qb, kb)`` where ``fn`` allows, 32 keys a word.
    Keys past ``S`` (a ragged last tile) are cleared; rows past ``L`` are never read."""
    P = tiles.shape[0]
    out = torch.empty(P, 2, TILE, dtype=torch.int32)
    ar = torch.arange(TILE)
    per_call = max(1, _POINTS_PER_CALL // (TILE * TILE))
    for t0 in range(0, P, per_call):
        t = tiles[t0:t0 + per_call]
        T = t.shape[0]
        q = (t[:, 2:3] * TILE + ar).clamp(max=L - 1).view(T, 1, TILE, 1)
        kv_raw = t[:, 3:4] * TILE + ar
        kv = kv_raw.clamp(max=S - 1).view(T, 1, 1, TILE)
        allowed = _mods.call(fn, t[:, 0].view(T, 1, 1, 1), t[:, 1].view(T, 1, 1, 1), q, kv)
        _m._check_bool(allowed, fn)
        want = (TILE, TILE, 1, T)[:allowed.dim()]
        if allowed.dim() > 4 or any(n not in (1, w) for n, w in zip(allowed.shape[::-1], want, strict=True)):
            raise ValueError(f"mask_mod gave shape {tuple(allowed.shape)} on stacked tiles (expected (T, 1, 64, 64))")
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape)).expand(T, 1, TILE, TILE)
        allowed = allowed[:, 0] & (kv_raw < S).view(T, 1, TILE)  # (T, rows, keys)
        out[t0:t0 + T] = _words(allowed)
    return out


def _words(allowed: torch.Tensor) -> torch.Tensor:
    """Tiles of points ``(T, 64 rows, 64 keys)`` bool as the kernel reads them, int32 ``(T, 2, 64)``: 8 keys a
    byte, key j at bit j % 8 of byte j // 8 ("little"); 4 bytes make a little-endian word whose bit j is key j."""
    packed = np.packbits(host_array(allowed.contiguous()), axis=-1, bitorder="little")
    return torch.from_numpy(packed.view("<u4").view(np.int32)).view(-1, TILE, 2).transpose(1, 2).contiguous()


def unpack(tb: TileBits, B: int, H: int, L: int, S: int) -> torch.Tensor:
    """The dense bool mask ``(B, H, L, S)`` a tile map describes (tests; O(L·S))."""
    TB, TH, nq, nk = tb.kinds.shape
    dense = torch.zeros(TB, TH, nq * TILE, nk * TILE, dtype=torch.bool)
    shifts = torch.arange(32, dtype=torch.int32)
    for b in range(TB):
        for h in range(TH):
            for i in range(nq):
                for j in range(nk):
                    kind = int(tb.kinds[b, h, i, j])
                    tile = dense[b, h, i * TILE:(i + 1) * TILE, j * TILE:(j + 1) * TILE]
                    if kind == 2:
                        tile[:] = True
                    elif kind == 1:
                        w = tb.bits[int(tb.index[b, h, i, j])]  # (2, 64)
                        tile[:] = ((w.t().unsqueeze(-1) >> shifts) & 1).reshape(TILE, TILE).bool()
    return dense[:, :, :L, :S].expand(B, H, L, S)


def _byte_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per byte value: its number of set bits, its lowest and its highest set bit (0 for the byte 0)."""
    v = range(256)
    return (torch.tensor([bin(x).count("1") for x in v]),
            torch.tensor([(x & -x).bit_length() - 1 if x else 0 for x in v]),
            torch.tensor([x.bit_length() - 1 if x else 0 for x in v]))


_BYTE_TABLES = _byte_tables()

# at most this many (tile, row) entries are read to find a tile map's row intervals (a few MB of work); a bigger
# map stays a tile map
_INTERVAL_ENTRIES_MAX = 1 << 22


def row_intervals(tb: TileBits, L: int, S: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(lo, hi)`` int32 ``(TB, L)`` where every query row of the tile map sees one stretch of keys ``[lo, hi)``
    (a window, causal documents, a prefix-LM written as a ``mask_mod`` or a BlockMask), the same for every head;
    else None. The kernel then runs the call on intervals, trimming partial tiles to what each row sees, as for
    a built-in mask, instead of masking whole tiles by their bits.

    A row is one stretch iff the number of keys it sees equals ``hi - lo`` for its smallest and largest key.
    Keys past ``S`` in a ragged last tile are never set. A row that sees nothing gets ``lo = hi = 0``."""
    done = tb.__dict__.get("_row_intervals", False)  # read once per tile map (maps are cached by content)
    if done is not False:
        return done
    got = _row_intervals(tb, L, S)
    object.__setattr__(tb, "_row_intervals", got)
    return got


def _row_intervals(tb: TileBits, L: int, S: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    kinds = tb.kinds
    TB, TH, nq, _ = kinds.shape
    if TH != 1:
        return None
    read = _native.tile_rows_fn()
    if read is not None and kinds.dtype is torch.int8 and kinds.is_contiguous() and tb.index.is_contiguous() \
            and tb.bits.is_contiguous():  # in C: one pass over the non-empty tiles' rows
        lo, hi = torch.empty(TB, L, dtype=torch.int32), torch.empty(TB, L, dtype=torch.int32)
        return (lo, hi) if read(kinds, tb.index, tb.bits, L, S, lo, hi) else None
    full = (kinds == FULL).nonzero()  # (F, 4)
    part = (kinds == PARTIAL).nonzero()  # (P, 4)
    if (full.shape[0] + part.shape[0] * 2) * TILE > _INTERVAL_ENTRIES_MAX:
        return None
    rows = torch.arange(TILE)
    big = torch.iinfo(torch.int64).max
    lo = torch.full((TB * nq * TILE,), big, dtype=torch.int64)
    hi = torch.zeros(TB * nq * TILE, dtype=torch.int64)
    cnt = torch.zeros(TB * nq * TILE, dtype=torch.int64)
    # full tiles: every row sees the tile's keys [kb * 64, min(S, kb * 64 + 64))
    if full.shape[0]:
        row = ((full[:, 0] * nq + full[:, 2]) * TILE).unsqueeze(1) + rows  # (F, 64)
        a = (full[:, 3] * TILE).unsqueeze(1).expand_as(row)
        e = (full[:, 3] * TILE + TILE).clamp(max=S).unsqueeze(1).expand_as(row)
        lo.scatter_reduce_(0, row.reshape(-1), a.reshape(-1), "amin")
        hi.scatter_reduce_(0, row.reshape(-1), e.reshape(-1), "amax")
        cnt.scatter_add_(0, row.reshape(-1), (e - a).reshape(-1))
    # partial tiles: each row's 64 bits (keys 0-31 in plane 0, 32-63 in plane 1, bit j = key j) as 8 bytes; the
    # count, first and last key seen from per-byte tables (exact integer work on (P, 64, 8) bytes)
    if part.shape[0]:
        w = tb.bits[tb.index[tuple(part.t())].long()].long()  # (P, 2, 64)
        m = ((w[:, 1] << 32) | (w[:, 0] & 0xFFFFFFFF)).contiguous()  # (P, 64) int64
        by = m.view(torch.uint8).view(m.shape[0], TILE, 8).long()  # little-endian: byte x holds keys 8x .. 8x+7
        pop8, low8, high8 = _BYTE_TABLES
        n = pop8[by].sum(-1)  # (P, 64)
        live = n > 0
        nz = by != 0
        at = torch.arange(8)
        lb = torch.where(nz, at, 8).amin(-1).clamp(max=7)  # the lowest / highest nonzero byte
        hb = torch.where(nz, at, -1).amax(-1).clamp(min=0)
        first = lb * 8 + low8[by.gather(-1, lb.unsqueeze(-1)).squeeze(-1)]
        last = hb * 8 + high8[by.gather(-1, hb.unsqueeze(-1)).squeeze(-1)]
        base = (part[:, 3] * TILE).unsqueeze(1)
        row = (((part[:, 0] * nq + part[:, 2]) * TILE).unsqueeze(1) + rows).expand_as(n)[live]
        lo.scatter_reduce_(0, row, (base + first)[live], "amin")
        hi.scatter_reduce_(0, row, (base + last + 1)[live], "amax")
        cnt.scatter_add_(0, row, n[live])
    lo, hi, cnt = lo.view(TB, nq * TILE)[:, :L], hi.view(TB, nq * TILE)[:, :L], cnt.view(TB, nq * TILE)[:, :L]
    dead = cnt == 0
    if not bool(((hi - lo == cnt) | dead).all()):
        return None
    lo = torch.where(dead, 0, lo)
    hi = torch.where(dead, 0, hi)
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()
