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

from .. import _mods
from .. import masks as _m
from .._tiling import PARTIAL

__all__ = ["TileBits", "TILE", "tile_bits", "plan_bits", "unpack"]

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
    if extra is not None:
        ek = extra.tile_kinds(B, H, L, S, TILE, TILE)
        shape = torch.broadcast_shapes(k64.shape, ek.shape)
        k64, mask = torch.minimum(k64.expand(shape), ek.expand(shape)), mask & extra
    tb = _with_bits(k64, mask, B, H, L, S)
    if key is not None and key[3] is not None:
        _keep(key, tb)
    return tb


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
        allowed = fn(t[:, 0].view(T, 1, 1, 1), t[:, 1].view(T, 1, 1, 1), q, kv)
        _m._check_bool(allowed, fn)
        want = (TILE, TILE, 1, T)[:allowed.dim()]
        if allowed.dim() > 4 or any(n not in (1, w) for n, w in zip(allowed.shape[::-1], want, strict=True)):
            raise ValueError(f"mask_mod gave shape {tuple(allowed.shape)} on stacked tiles (expected (T, 1, 64, 64))")
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape)).expand(T, 1, TILE, TILE)
        allowed = allowed[:, 0] & (kv_raw < S).view(T, 1, TILE)  # (T, rows, keys)
        # 8 keys a byte, key j at bit j % 8 of byte j // 8 ("little"); 4 bytes make a little-endian word whose
        # bit j is key j: (T, rows, 2 words)
        packed = np.packbits(allowed.contiguous().numpy(), axis=-1, bitorder="little")
        words = torch.from_numpy(packed.view("<u4").view(np.int32)).view(T, TILE, 2)
        out[t0:t0 + T] = words.transpose(1, 2)
    return out


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
