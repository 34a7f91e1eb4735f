"""Attention masks as index functions, FlexAttention style.

Boolean masks in attnkit mean **True = attend** (as in torch SDPA, JAX and
FlexAttention; the opposite of ``torch.nn.MultiheadAttention``).

A mask is an object with a ``mask_mod``: a pure function of tensors of indices,
``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``, evaluated with broadcasting.
Built-in masks know the query and key lengths (``L``, ``S``) they are used
with, because bottom-right causal alignment depends on ``S - L``; ``bind(L, S)``
returns the plain FlexAttention-compatible ``mask_mod`` for those sizes.

Shape legend: B batch, H query heads, L query length, S key length.

Query positions are **bottom-right aligned** to the keys by default: query row
``i`` sits at key position ``i + S - L`` (so a single decoding query sees the
whole cache). Causal, both alignments, for L = 3, S = 5 (``#`` attend)::

    bottom_right (default)      top_left
        k0 k1 k2 k3 k4            k0 k1 k2 k3 k4
    q0   #  #  #  .  .        q0   #  .  .  .  .
    q1   #  #  #  #  .        q1   #  #  .  .  .
    q2   #  #  #  #  #        q2   #  #  #  .  .

Masks combine with ``&`` (both allow), ``|`` (either allows) and ``~`` (not).
``mask.materialize(B, H, L, S)`` gives the dense ``(B, H, L, S)`` bool tensor
(for references and tests; the fast backend never builds it), and ``str(mask)``
draws it for a small size.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from . import _mods, _ranges, _tiling
from ._args import as_int
from ._tiling import EMPTY, FULL, PARTIAL, edges, kinds_from

__all__ = [
    "Mask",
    "causal",
    "sliding_window",
    "padding",
    "key_padding",
    "chunked",
    "document",
    "prefix_lm",
    "from_mod",
    "full",
]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_ALIGNS = ("bottom_right", "top_left")


def _check_align(align: str) -> str:
    if align not in _ALIGNS:
        raise ValueError(
            f"align: expected one of {_ALIGNS}, got {align!r}. "
            "Use 'bottom_right' (default, right for KV-cache decoding) or 'top_left'."
        )
    return align


def _offset(align: str, L: int, S: int) -> int:
    """Key position of query row 0: ``S - L`` bottom-right, ``0`` top-left."""
    return S - L if align == "bottom_right" else 0


def _check_int(name: str, value, minimum: int) -> int:
    n = as_int(value)
    if n is None:
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__} {value!r}.")
    value = n
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}. Pass a value >= {minimum}.")
    return value


_MAX_SIZE = 1 << 62  # a chunk's size: every cache fits, and int64 arithmetic on it cannot overflow


def _no_key(self):
    return None


class Mask:
    """Base class of attnkit masks. Subclasses define ``bind(L, S)``.

    ``bind(L, S)`` returns ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` for a
    query length ``L`` and key length ``S``. Indices are integer tensors that
    broadcast against each other.
    """

    #: Number of batch rows the mask is specific to (``None``: any batch size).
    batch_size: int | None = None
    #: True: the tiles are the same for every head, and for every batch row beyond ``batch_size``'s own data (a
    #: context-parallel schedule then plans one head of one row). False: they may depend on ``b`` / ``h`` (every
    #: row and head is planned). attnkit's closed-form masks say True; a ``mask_mod``, a BlockMask read as a mask
    #: and a subclass written outside attnkit say False unless the subclass sets it itself (an inherited True
    #: would vouch for a ``bind`` it overrides).
    same_for_every_head: bool = False

    def cache_key(self):
        """A hashable key that fixes this mask's tiles at given sizes, or None (plan it afresh).

        Built-in masks are immutable values (they copy their data at construction), so the
        object itself is the key. An opaque ``mask_mod`` has a key only when everything it
        reads besides its indices is an immutable value (see ``attnkit._mods.value_key``).
        A subclass written outside attnkit has none unless it defines its own: its state, and
        what it overrides, are its own (an inherited key would name another mask's tiles).
        """
        return self

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.__module__.startswith("attnkit.") and "cache_key" not in cls.__dict__:
            cls.cache_key = _no_key  # type: ignore[method-assign]
        if not cls.__module__.startswith("attnkit.") and "same_for_every_head" not in cls.__dict__:
            cls.same_for_every_head = False

    def bind(self, L: int, S: int) -> MaskMod:  # pragma: no cover - abstract
        raise NotImplementedError

    def flex_mask_mod(self, L: int, S: int) -> MaskMod:
        """The plain FlexAttention ``mask_mod`` for these sizes (scalar semantics; for a
        ``BlockMask``). Built-in masks' ``bind`` already is one."""
        return self.bind(L, S)

    def flex_mask_mod_on(self, L: int, S: int, device) -> MaskMod:
        """:meth:`flex_mask_mod` for FlexAttention's kernels on ``device``: a mask reading a tensor (lengths, ids)
        reads a copy already there, so the compiled kernel loads it (a copy made inside a ``mask_mod`` is not
        something torch's GPU kernels can compile). None: as :meth:`flex_mask_mod`."""
        return self.flex_mask_mod(L, S)

    def points_mod(self, B: int, H: int, L: int, S: int) -> MaskMod:
        """The ``mask_mod`` for index tensors that broadcast to any shape, not only the ``(B, H, L, S)``
        grid: e.g. many tiles stacked on the batch dim (``b, h (T, 1, 1, 1)``, ``q (T, 1, bm, 1)``,
        ``kv (T, 1, 1, bn)``), as the compiled kernel's tile map evaluates partial tiles. Built-in
        masks' ``bind`` already broadcasts this way."""
        return self.bind(L, S)

    def key_span(self, B: int, H: int, L: int, S: int) -> tuple[int, int]:
        """``[j0, j1)`` containing every key some query can see (conservative). Built-in masks
        answer in closed form; this default reads it off the tile kinds of 64-key blocks."""
        if L == 0 or S == 0:  # no query rows (or keys): no key is seen
            return 0, 0
        kinds = self.tile_kinds(B, H, L, S, L, 64)
        live = (kinds != EMPTY).flatten(0, 2).any(dim=0).nonzero()
        if live.numel() == 0:
            return 0, 0
        return int(live[0]) * 64, min(S, (int(live[-1]) + 1) * 64)

    def decode_tile(self, B: int, L: int, S: int, device) -> tuple[int, int, torch.Tensor] | None:
        """For a decode-sized call (a few query rows): ``(j0, j1, allowed)``, the keys ``[j0, j1)``
        some query can see and a bool tensor broadcastable to ``(B, 1, L, j1 - j0)`` over them
        (True = attend), built in closed form in one or two ops; or None: not offered by this
        mask, these sizes are not valid for it, or some query row would see no key (the caller
        then takes the general path, which validates and handles empty rows)."""
        return None

    def row_intervals(self, B: int, L: int, S: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per query row, the one stretch of keys it sees, when the mask is such a stretch.

        ``(lo, hi)``: int32 CPU tensors of shape ``(1, L)`` (same for the batch) or ``(B, L)``;
        row ``i`` sees keys ``lo <= j < hi`` (``lo >= hi``: none). ``None`` when some row's
        visible keys are not one contiguous stretch (or the mask differs per head). The
        compiled kernel masks partial tiles with these two edges; O(B·L), no (L, S) evaluation::

            causal, L = S = 4       lo  hi           sliding_window(2)   lo  hi
            q0  █ · · ·              0   1           q0  █ · · ·          0   1
            q1  █ █ · ·              0   2           q1  █ █ · ·          0   2
            q2  █ █ █ ·              0   3           q2  · █ █ ·          1   3
            q3  █ █ █ █              0   4           q3  · · █ █          2   4
        """
        return None

    def tile_kinds(self, B: int, H: int, L: int, S: int, bm: int, bn: int) -> torch.Tensor:
        """int8 kinds ``(Bp, Hp, ceil(L/bm), ceil(S/bn))`` of EMPTY / PARTIAL / FULL tiles
        (see :mod:`attnkit._tiling`). Built-in masks answer in closed form from the tile
        corners; this default evaluates the mask on chunks of whole query blocks (never
        L×S at once), keeping the batch and head dims the mask depends on."""
        return _evaluated_kinds(self.bind(L, S), B, H, L, S, bm, bn)

    def _kinds_counted(self, B: int, H: int, L: int, S: int, bm: int, bn: int) -> tuple[torch.Tensor, int]:
        """``(tile_kinds, number of tiles whose points were evaluated)``: 0 for a closed form,
        every tile for a mask known only by its ``bind`` (the default ``tile_kinds``)."""
        kinds = self.tile_kinds(B, H, L, S, bm, bn)
        point = type(self).tile_kinds is Mask.tile_kinds
        return kinds, (kinds.numel() if point else 0)

    def validate(self, B: int, H: int, L: int, S: int) -> None:
        """Raise ``ValueError`` if this mask cannot be used for these sizes."""
        if self.batch_size is not None and self.batch_size not in (1, B):
            raise ValueError(
                f"mask: {self!r} was built for batch size {self.batch_size}, but the inputs have "
                f"B={B}. Build the mask from per-batch data with {B} rows."
            )

    def materialize(self, B: int, H: int, L: int, S: int, device=None) -> torch.Tensor:
        """Dense ``(B, H, L, S)`` bool tensor, True = attend (for references and tests)."""
        self.validate(B, H, L, S)
        b = torch.arange(B, device=device).view(B, 1, 1, 1)
        h = torch.arange(H, device=device).view(1, H, 1, 1)
        q = torch.arange(L, device=device).view(1, 1, L, 1)
        kv = torch.arange(S, device=device).view(1, 1, 1, S)
        out = self.bind(L, S)(b, h, q, kv)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            raise TypeError(
                f"mask_mod of {self!r} must return a bool tensor, got "
                f"{type(out).__name__}{'' if not isinstance(out, torch.Tensor) else ' of ' + str(out.dtype)}. "
                "Use comparisons and &, |, ~ on the index tensors."
            )
        return out.expand(B, H, L, S)

    def __and__(self, other: Mask) -> Mask:
        return And(self, _as_mask(other, "&"))

    def __or__(self, other: Mask) -> Mask:
        return Or(self, _as_mask(other, "|"))

    def __invert__(self) -> Mask:
        return Not(self)

    def _natural_size(self) -> tuple[int, int] | None:
        """(L, S) the mask's own data fixes (document ids), or None."""
        return None

    def draw(self, L: int | None = None, S: int | None = None, b: int = 0, h: int = 0) -> str:
        """ASCII picture of the mask for one (batch, head): ``#`` attend, ``.`` masked.

        Default size: the mask's own (one row per document id) or 8 × 8.
        """
        nat = self._natural_size()
        if L is None:
            L = nat[0] if nat else 8
        if S is None:
            S = nat[1] if nat else L
        B = max(self.batch_size or 1, b + 1)
        dense = self.materialize(B, h + 1, L, S)[b, h]
        width = len(str(S - 1))
        head = " " * (len(str(L - 1)) + 2) + " ".join(f"{j:>{width}}" for j in range(S))
        rows = [head]
        for i in range(L):
            cells = " ".join(("#" if dense[i, j] else ".").rjust(width) for j in range(S))
            rows.append(f"q{i:<{len(str(L - 1))}} {cells}")
        return "\n".join(rows)

    def _repr_html_(self) -> str | None:
        from ._display import html

        return html("mask", self)

    def __str__(self) -> str:
        try:
            return f"{self!r}\n{self.draw()}"
        except (ValueError, TypeError, IndexError, RuntimeError) as e:  # a mask_mod that cannot run at 8 × 8
            return f"{self!r}\n(not drawn at the default size: {e}; use mask.draw(L, S))"


def _intervals(lo, hi, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_intervals``' result: edges clamped to [0, S], int32, contiguous. ``lo`` / ``hi``: tensors, or int64
    NumPy arrays (the closed-form masks compute in NumPy: a decode loop asks for new intervals at every step, and a
    NumPy op costs a fraction of a torch op's ~3 µs)."""
    if isinstance(lo, np.ndarray):
        return _clip32(lo, S), _clip32(hi, S)
    return (lo.clamp(0, S).to(torch.int32).contiguous(), hi.clamp(0, S).to(torch.int32).contiguous())


def _clip32(x: np.ndarray, S: int) -> torch.Tensor:
    y = np.maximum(x, 0)  # (np.clip costs ~10 µs on a small array, these two ~1.5 µs each)
    np.minimum(y, S, out=y)
    return torch.from_numpy(y.astype(np.int32))  # a C-contiguous copy


def _positions(L: int, off) -> np.ndarray:
    """(1, L) int64: the key position ``i + off`` of each query row ``i`` (``off`` an int, or an (n, 1) int64
    array of offsets, one per key count S: then (n, L))."""
    return np.arange(L, dtype=np.int64).reshape(1, L) + off


def _cap(size: int, L: int, S) -> int:
    """``size`` capped to S + L + 1 (the largest S of an array): wider than every position, so the same rows, and a
    Python int NumPy's int64 holds (a window of 2**70 keys is legal)."""
    return min(size, int(np.max(S)) + L + 1)


def _band_kinds(off: int, w: int | None, L: int, S: int, bm: int, bn: int) -> torch.Tensor:
    """Kinds of "query row i (key position p = i + off) sees keys p - w < j <= p" (w None: no
    lower bound), from the first/last row and column of each tile (interval arithmetic)."""
    qlo, qhi = edges(L, bm)
    klo, khi = edges(S, bn)
    full = khi[None, :] <= qlo[:, None] + off
    empty = klo[None, :] > qhi[:, None] + off
    if w is not None:
        full &= klo[None, :] > qhi[:, None] + off - w
        empty |= khi[None, :] <= qlo[:, None] + off - w
    return kinds_from(full, empty)[None, None]


# A user mask_mod is evaluated on about this many (b, h, q, kv) points per chunk.
_EVAL_ELEMS = 1 << 22


def _evaluated_kinds(mod, B, H, L, S, bm, bn) -> torch.Tensor:
    """Kinds of a mask known only by its mask_mod: evaluated on chunks of whole query blocks,
    keeping the (b, h) dims the result depends on (a mod that ignores b gives Bp = 1)."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    kv = torch.arange(S).view(1, 1, 1, S)
    nk = -(-S // bn)
    first = _mods.call(mod, b, h, torch.arange(min(L, bm)).view(1, 1, -1, 1), kv)
    _check_bool(first, mod)
    Bp, Hp = first.shape[0] if first.dim() == 4 else 1, first.shape[1] if first.dim() >= 3 else 1
    rows = max(bm, (_EVAL_ELEMS // max(S * Bp * Hp, 1)) // bm * bm)
    # One output allocated up front, filled in place: keeping a small tensor per chunk alive
    # between the chunks' large temporaries fragments the heap (measured: 3.6 GiB peak for the
    # tile map of a 64k window mask_mod, 0.25 GiB with this).
    out = torch.empty(Bp, Hp, -(-L // bm), nk, dtype=torch.int8)
    for r0 in range(0, L, rows):
        r1 = min(L, r0 + rows)
        if r0 == 0 and r1 == min(L, bm):
            allowed = first
        else:
            allowed = _mods.call(mod, b, h, torch.arange(r0, r1).view(1, 1, -1, 1), kv)
        _check_bool(allowed, mod)
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape)).expand(Bp, Hp, r1 - r0, S)
        out[:, :, r0 // bm:-(-r1 // bm)] = _tiling.reduce_allowed(allowed, bm, bn)
        del allowed
    return out


def lead_shape(fn, B: int, H: int, L: int, S: int, rows: int = 64, cols: int = 64) -> tuple[int, int]:
    """``(Bp, Hp)``: the batch / head dims of a points function's answer on the first ``rows × cols`` points at
    every ``b < B``, ``h < H`` — 1 where it does not depend on the batch row / head, the rule by which a mask_mod's
    tiles keep those dims (:func:`_evaluated_kinds`)."""
    allowed = _mods.call(fn, torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
                         torch.arange(min(L, rows)).view(1, 1, -1, 1), torch.arange(min(S, cols)).view(1, 1, 1, -1))
    shape = (1,) * (4 - allowed.dim()) + tuple(allowed.shape)
    return shape[0], shape[1]


# A mask_mod's grid of a decode step (at most this many query rows and points: one query row over a few thousand
# keys) is evaluated whole and its tiles counted with NumPy: ~90 µs at (1, 1200), where range analysis costs ~200
# (torch's per-op costs); more rows keep the range analysis (its tiles decided without their points)
_SMALL_GRID, _SMALL_GRID_ROWS = 1 << 15, 16


def small_grid_points(mod, B, H, L, S) -> np.ndarray:
    """A small grid's points (``B·H·L·S <= _SMALL_GRID``): ``mod`` called once on fresh index tensors, its answer
    as a bool NumPy array ``(Bp, Hp, L, S)`` (Bp, Hp: 1 where it does not depend on the batch row / head)."""
    idx = [torch.from_numpy(np.arange(n, dtype=np.int64).reshape(shape)) for n, shape in  # fresh: a mod may write
           ((B, (B, 1, 1, 1)), (H, (1, H, 1, 1)), (L, (1, 1, L, 1)), (S, (1, 1, 1, S)))]
    allowed = _mods.call(mod, *idx)
    _check_bool(allowed, mod)
    x = _tiling.host_array(allowed.cpu())  # (not .numpy(): a mod may hand back the user's own tensor)
    if x.ndim < 4:
        x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    return x if x.shape[2:] == (L, S) else np.broadcast_to(x, (x.shape[0], x.shape[1], L, S))


def points_kinds(x: np.ndarray, L: int, S: int, bm: int, bn: int) -> torch.Tensor:
    """The tile kinds ``(Bp, Hp, nq, nk)`` of bool points ``x (Bp, Hp, L, S)``, counted in NumPy (a ragged edge
    tile is full when all its real points are)."""
    nq, nk = -(-L // bm), -(-S // bn)
    row = (_tiling.row_bytes(x[0, 0, 0]) if x.shape[:2] == (1, 1) and (L == 1 or x.strides[2] == 0)
           and nq * nk <= 256 else None)
    if row is not None:  # a decode step's one row of keys for every query: its bytes counted per key block
        counts = [row.count(1, j, j + bn) for j in range(0, S, bn)]  # every query block alike (one row for all)
        line = [EMPTY if n == 0 else FULL if n == min(bn, S - j * bn) else PARTIAL for j, n in enumerate(counts)]
        return torch.from_numpy(np.array(line * nq, dtype=np.int8).reshape(1, 1, nq, nk))
    r0, c0 = np.arange(nq) * bm, np.arange(nk) * bn  # each tile's first row and key
    area = np.minimum(bm, L - r0)[:, None] * np.minimum(bn, S - c0)[None, :]
    count = np.add.reduceat(np.add.reduceat(x, r0, axis=2, dtype=np.int64), c0, axis=3)  # over rows, then keys
    kinds = np.full(count.shape, PARTIAL, dtype=np.int8)
    kinds[count == area] = FULL
    kinds[count == 0] = EMPTY
    return torch.from_numpy(kinds)


def small_grid(B: int, H: int, L: int, S: int) -> bool:
    """Whether a call of these sizes is a decode step's few points, evaluated whole (:func:`small_grid_points`)."""
    return L <= _SMALL_GRID_ROWS and B * H * L * S <= _SMALL_GRID


def _small_grid_kinds(mod, B, H, L, S, bm, bn) -> torch.Tensor:
    """:func:`_evaluated_kinds` of a small grid (``B·H·L·S <= _SMALL_GRID``): one evaluation of every point, the
    tiles' counts in NumPy; the same kinds (a ragged edge tile is full when all its real points are)."""
    return points_kinds(small_grid_points(mod, B, H, L, S), L, S, bm, bn)


# Tiles per range-evaluation call: bounds the interval temporaries (a few int64 per tile).
_RANGE_TILES = 1 << 21


def _range_kinds(fn, B, H, L, S, bm, bn) -> tuple[torch.Tensor, int]:
    """Kinds of a broadcast-safe ``mask_mod`` by range evaluation (see :mod:`attnkit._ranges`).

    1. ranges: one call of ``fn`` on per-tile index intervals (per chunk of query blocks, to
       bound memory) calls each tile surely full, surely empty, or undecided;
    2. witnesses: each undecided tile is evaluated at a 4 × 4 grid of its points (first, two
       inner and last row / column); a True and a False there prove it partial;
    3. points: the tiles still undecided are evaluated at every point (``_point_kinds``).

    Returns the kinds and the number of tiles whose points were evaluated (steps 2-3).
    Raises ``_ranges.Unsupported`` when the mod does something intervals do not follow
    (the caller then evaluates every point)."""
    qlo, qhi = edges(L, bm)
    klo, khi = edges(S, bn)
    nk = klo.numel()
    rows = max(1, _RANGE_TILES // max(nk, 1))
    with _ranges.checked_once():
        kinds = _range_chunks(fn, B, H, qlo, qhi, klo, khi, rows)
    mixed = (kinds == PARTIAL).nonzero()  # (T, 4): (b, h, query block, key block)
    if mixed.shape[0]:
        try:
            got = _point_kinds(fn, mixed, L, S, bm, bn, witness=True)
            undecided = got != PARTIAL  # the samples were all True or all False: not a proof
            if bool(undecided.any()):
                got[undecided] = _point_kinds(fn, mixed[undecided], L, S, bm, bn)
        except Exception as e:  # a mod that cannot run on stacked tiles: every point decides
            raise _ranges.Unsupported(f"stacked tiles: {type(e).__name__}: {e}") from e
        kinds[tuple(mixed.t())] = got
    return kinds, int(mixed.shape[0])


def _range_chunks(fn, B, H, qlo, qhi, klo, khi, rows):
    """Step 1 of ``_range_kinds``, ``rows`` query blocks per call: kinds (Bp, Hp, nq, nk)."""
    nq, nk = qlo.numel(), klo.numel()
    b_all, h_all = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    kinds, Bp, Hp = None, None, None
    for r0 in range(0, nq, rows):
        r1 = min(nq, r0 + rows)
        surely, possibly = _ranges.evaluate(fn, b_all, h_all, qlo[r0:r1].view(1, 1, -1, 1),
                                            qhi[r0:r1].view(1, 1, -1, 1), klo.view(1, 1, 1, nk), khi.view(1, 1, 1, nk))
        surely, possibly, shape = _range_result(surely, possibly, B, H, r1 - r0, nk)
        if kinds is None:
            Bp, Hp = shape[0], shape[1]
            kinds = torch.empty(Bp, Hp, nq, nk, dtype=torch.int8)
        elif (shape[0], shape[1]) != (Bp, Hp):
            raise _ranges.Unsupported("a result whose batch / head dims change between chunks")
        # EMPTY 0 / PARTIAL 1 / FULL 2 is the count of (surely, possibly) that hold: sound intervals
        # never give surely without possibly, and if they did it would read PARTIAL (points decide)
        kinds[:, :, r0:r1] = surely.to(torch.int8) + possibly.to(torch.int8)
    return kinds


def _range_result(surely, possibly, B, H, nq, nk):
    """The range result as ``(Bp, Hp, nq' | 1, nk' | 1)`` tensors, or Unsupported if its shape is
    not one of the grid's."""
    try:
        surely, possibly = torch.broadcast_tensors(surely, possibly)
    except RuntimeError as e:
        raise _ranges.Unsupported(str(e)) from e
    if surely.dim() > 4:
        raise _ranges.Unsupported("a result of more than 4 dims")
    shape = (1,) * (4 - surely.dim()) + tuple(surely.shape)
    if shape[0] not in (1, B) or shape[1] not in (1, H) or shape[2] not in (1, nq) or shape[3] not in (1, nk):
        raise _ranges.Unsupported(f"a result of shape {shape}")
    return surely.reshape(shape), possibly.reshape(shape), shape


def _samples(blk: int, witness: bool) -> torch.Tensor:
    """Offsets inside a block: all ``blk`` of them, or 4 witnesses (first, two inner, last)."""
    if not witness or blk <= 4:
        return torch.arange(blk)
    return torch.tensor([0, blk // 3, (2 * blk) // 3, blk - 1])


def _point_kinds(fn, tiles: torch.Tensor, L, S, bm, bn, witness: bool = False) -> torch.Tensor:
    """Kinds of the tiles ``(T, 4)`` = (b, h, query block, key block) from ``fn`` at their points,
    many tiles per call: the tiles are stacked on the batch dim::

        b (T, 1, 1, 1)   h (T, 1, 1, 1)   q_idx (T, 1, bm, 1)   kv_idx (T, 1, 1, bn)

    Exact with every point; ``witness=True`` samples a 4 × 4 grid of rows × columns, where only
    a PARTIAL answer (a True and a False seen) is a proof. A ragged last block repeats its last
    row / column (a repeat changes no all / any)."""
    out = torch.empty(tiles.shape[0], dtype=torch.int8)
    ar_q, ar_k = _samples(bm, witness), _samples(bn, witness)
    lq, lk = ar_q.numel(), ar_k.numel()
    per_call = max(1, _EVAL_ELEMS // (lq * lk))
    for t0 in range(0, tiles.shape[0], per_call):
        t = tiles[t0:t0 + per_call]
        T = t.shape[0]
        b = t[:, 0].view(T, 1, 1, 1)
        h = t[:, 1].view(T, 1, 1, 1)
        q = (t[:, 2:3] * bm + ar_q).clamp(max=L - 1).view(T, 1, lq, 1)
        kv = (t[:, 3:4] * bn + ar_k).clamp(max=S - 1).view(T, 1, 1, lk)
        allowed = _mods.call(fn, b, h, q, kv)
        _check_bool(allowed, fn)
        if not _mods._fits(allowed, (T, 1, lq, lk)):
            raise _ranges.Unsupported(f"stacked tiles gave shape {tuple(allowed.shape)}")
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape)).expand(T, 1, lq, lk)
        flat = allowed.reshape(T, lq * lk)
        out[t0:t0 + T] = torch.where(flat.all(-1), FULL, torch.where(flat.any(-1), PARTIAL, EMPTY)).to(torch.int8)
    return out


def _check_bool(out, mod):
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        got = type(out).__name__ if not isinstance(out, torch.Tensor) else f"a tensor of {out.dtype}"
        raise TypeError(f"mask_mod {getattr(mod, '__name__', '')!r} must return a bool tensor (True = attend), "
                        f"got {got}. Use comparisons and &, |, ~ on the index tensors.")


def _as_mask(obj, op: str) -> Mask:
    if isinstance(obj, Mask):
        return obj
    raise TypeError(
        f"mask {op}: expected an attnkit mask on both sides, got {type(obj).__name__}. "
        "Wrap a function with attnkit.masks.from_mod(fn)."
    )


class Full(Mask):
    """Every query sees every key (the neutral element of ``&``)."""

    same_for_every_head = True

    def bind(self, L, S):
        return lambda b, h, q, kv: (q >= 0) & (kv >= 0)

    def tile_kinds(self, B, H, L, S, bm, bn):
        return torch.full((1, 1, -(-L // bm), -(-S // bn)), FULL, dtype=torch.int8)

    def row_intervals(self, B, L, S):
        return _intervals(*self._row_edges(L, S), S)

    def _row_edges(self, L: int, S) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) int64 edges before the clamp to [0, S]; ``S`` an int or an (n, 1) array (see ``_positions``)."""
        return np.zeros((1, L), np.int64), np.zeros((1, L), np.int64) + S

    def cache_key(self):
        return ("full",)  # a value: every full() has the same tiles

    def __repr__(self):
        return "full()"


class Causal(Mask):
    """Query ``i`` sees keys ``j <= i + offset`` (``offset = S - L`` bottom-right, 0 top-left)."""

    same_for_every_head = True

    def __init__(self, align: str = "bottom_right"):
        self.align = _check_align(align)

    def bind(self, L, S):
        off = _offset(self.align, L, S)
        return lambda b, h, q, kv: kv <= q + off

    def tile_kinds(self, B, H, L, S, bm, bn):
        return _band_kinds(_offset(self.align, L, S), None, L, S, bm, bn)

    def cache_key(self):
        return ("causal", self.align)  # a value: every causal mask of one alignment has the same tiles

    def key_span(self, B, H, L, S):
        return 0, max(0, min(S, L - 1 + _offset(self.align, L, S) + 1))

    def decode_tile(self, B, L, S, device):
        off = _offset(self.align, L, S)
        if off < 0:  # bottom-right with L > S: the first rows see no key
            return None
        j1 = min(S, L + off)  # row i sees keys j <= i + off
        return 0, j1, torch.ones(L, j1, dtype=torch.bool, device=device).tril_(off)

    def row_intervals(self, B, L, S):
        return _intervals(*self._row_edges(L, S), S)

    def _row_edges(self, L: int, S) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((1, L), np.int64), _positions(L, _offset(self.align, L, S)) + 1

    def __repr__(self):
        return f"causal(align={self.align!r})"


class SlidingWindow(Mask):
    """Query at key position ``p = i + offset`` sees keys ``p - size < j <= p`` (itself and ``size - 1`` before)."""

    same_for_every_head = True

    def __init__(self, size: int, align: str = "bottom_right"):
        self.size = _check_int("size", size, 1)
        self.align = _check_align(align)

    def bind(self, L, S):
        off, w = _offset(self.align, L, S), self.size
        return lambda b, h, q, kv: (kv <= q + off) & (kv > q + off - w)

    def tile_kinds(self, B, H, L, S, bm, bn):
        return _band_kinds(_offset(self.align, L, S), self.size, L, S, bm, bn)

    def cache_key(self):
        return ("sliding_window", self.size, self.align)

    def key_span(self, B, H, L, S):
        off = _offset(self.align, L, S)  # query i sees keys off + i - size < j <= off + i
        return max(0, off - self.size + 1), max(0, min(S, L - 1 + off + 1))

    def decode_tile(self, B, L, S, device):
        if L > S:  # some row would see no key (bottom-right: the first ones; top-left: the last ones)
            return None
        off, w = _offset(self.align, L, S), self.size
        j0, j1 = max(0, off - w + 1), min(S, L + off)
        # local column c = j - j0; row i keeps off + i - w < j <= off + i
        t = torch.ones(L, j1 - j0, dtype=torch.bool, device=device)
        return j0, j1, t.tril_(off - j0).triu_(off - j0 - w + 1)

    def row_intervals(self, B, L, S):
        return _intervals(*self._row_edges(L, S), S)

    def _row_edges(self, L: int, S) -> tuple[np.ndarray, np.ndarray]:
        p = _positions(L, _offset(self.align, L, S))
        return p - _cap(self.size, L, S) + 1, p + 1

    def __repr__(self):
        return f"sliding_window({self.size}, align={self.align!r})"


def _as_tensor(name: str, value, expected: str) -> torch.Tensor:
    """``torch.as_tensor(value)``, or a TypeError naming ``name`` and what was expected (torch's own says
    "new(): invalid data type 'str'")."""
    if isinstance(value, (str, bytes)) or not (isinstance(value, (torch.Tensor, np.ndarray, list, tuple, range))
                                               or np.isscalar(value)):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r:.60}.")
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name}: expected {expected}, got {value!r:.60} ({e}).") from None


def _int_vector(name: str, value, ndim_ok=(1,)) -> torch.Tensor:
    """A private long copy of ``value``: masks are immutable values, so changing the caller's
    array or tensor afterwards (in place or not) never changes the mask or its cached plan."""
    t = _as_tensor(name, value, "integers (a list, NumPy array or tensor)")
    if t.dim() == 0:
        raise ValueError(f"{name}: expected {' or '.join(f'{d}-D' for d in ndim_ok)} integers, got the single "
                         f"number {t.item()!r}. Pass a list, e.g. [{t.item()!r}].")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name}: expected integers, got dtype {t.dtype}. Pass an int array/tensor/list.")
    if t.dim() not in ndim_ok:
        raise ValueError(f"{name}: expected {' or '.join(f'{d}-D' for d in ndim_ok)}, got shape {tuple(t.shape)}.")
    return t.detach().to(device="cpu", dtype=torch.long, copy=True)


class Padding(Mask):
    """Per batch row ``b``: keys ``j < key_lengths[b]`` are visible (right padding).

    A value: ``key_lengths`` is a private copy made at construction, and reading the attribute
    gives a copy of it, so ``m.key_lengths[1] = 40`` changes nothing (tile maps and work lists
    are cached per mask object; a change behind them would make backends disagree).
    """

    same_for_every_head = True

    key_lengths = property(lambda self: self._key_lengths.clone(), doc="(B,) lengths (a copy).")

    def __init__(self, key_lengths):
        self._key_lengths = _int_vector("key_lengths", key_lengths)
        if (self._key_lengths < 0).any():
            raise ValueError(f"key_lengths: expected lengths >= 0, got {self._key_lengths.tolist()}.")
        self.batch_size = int(self._key_lengths.numel())
        # Python ints of the immutable lengths: validation and key spans without a tensor op
        self._max = int(self._key_lengths.max()) if self.batch_size else 0
        self._min = int(self._key_lengths.min()) if self.batch_size else 0
        self._on = {}  # device -> decode_tile's mask there
        self._key = ("padding", tuple(self._key_lengths.tolist()))  # a value: the immutable lengths

    def cache_key(self):
        return self._key

    def validate(self, B, H, L, S):
        if self.batch_size != B:
            raise ValueError(
                f"key_lengths: expected one length per batch row ({B}), got {self.batch_size}. "
                "Pass a length for every sequence in the batch."
            )
        if self._max > S:
            raise ValueError(
                f"key_lengths: lengths must be <= S={S}, got max {self._max}. "
                "A length longer than the keys would be silently truncated; fix the lengths."
            )

    def bind(self, L, S):
        lengths = self._key_lengths
        return lambda b, h, q, kv: kv < lengths.to(kv.device)[b]

    def flex_mask_mod_on(self, L, S, device):
        if device is None:
            return self.flex_mask_mod(L, S)
        lengths = self._key_lengths.to(device)
        return lambda b, h, q, kv: kv < lengths[b]

    def tile_kinds(self, B, H, L, S, bm, bn):
        klo, khi = edges(S, bn)
        lens = self._key_lengths.view(-1, 1, 1, 1)  # (B, 1, 1, 1): one row of kinds per sequence
        full = (khi.view(1, 1, 1, -1) < lens).expand(-1, 1, -(-L // bm), -1)
        empty = (klo.view(1, 1, 1, -1) >= lens).expand(-1, 1, -(-L // bm), -1)
        return kinds_from(full, empty)

    def _natural_size(self):
        S = max(8, int(self._key_lengths.max()) if self._key_lengths.numel() else 0)
        return (S, S)

    def key_span(self, B, H, L, S):
        return 0, min(S, self._max)

    def decode_tile(self, B, L, S, device):
        if self.batch_size != B or self._max > S or self._min < 1:  # invalid, or a row sees no key
            return None
        # over the keys up to the longest row, or over all S when that cuts less than a tenth
        # (a fresh view of K/V costs a decode step more than the few keys it saves)
        n = self._max if self._max < 0.9 * S else S
        key = (str(device), n)
        allowed = self._on.get(key)  # (B, 1, 1, n): a function of the immutable lengths and n only
        if allowed is None:
            allowed = torch.arange(n, device=device) < self._key_lengths.to(device).view(B, 1, 1, 1)
            if len(self._on) > 8:
                self._on.clear()
            self._on[key] = allowed
        return 0, n, allowed

    def row_intervals(self, B, L, S):
        hi = self._key_lengths.view(-1, 1).expand(-1, L)
        return _intervals(torch.zeros_like(hi), hi, S)

    def __repr__(self):
        return f"padding({self._key_lengths.tolist()})"


class KeyPadding(Mask):
    """Per batch row ``b``: key ``j`` is visible where ``valid[b, j]`` (any padding pattern:
    left padding, holes). ``valid``: bool ``(B, S)``, copied (an immutable value; reading
    ``m.valid`` gives a copy)."""

    same_for_every_head = True

    valid = property(lambda self: self._valid.clone(), doc="bool (B, S) flags (a copy).")

    def __init__(self, valid):
        t = _as_tensor("valid", valid, "a bool array/tensor (B, S)")
        if t.dtype != torch.bool:
            raise TypeError(f"valid: expected a bool array/tensor (B, S), True = a real key, got dtype {t.dtype}. "
                            "Convert a 0/1 attention mask with .bool() / .astype(bool).")
        if t.dim() != 2:
            raise ValueError(f"valid: expected shape (B, S), got {tuple(t.shape)}.")
        self._valid = t.detach().to("cpu", copy=True)
        self.batch_size = int(self._valid.shape[0])
        self._every_row_sees_a_key = bool(self._valid.any(-1).all())
        self._on = {}  # device -> the same values there (for decode_tile)

    def validate(self, B, H, L, S):
        if self.batch_size != B or self._valid.shape[1] != S:
            raise ValueError(f"valid: expected shape (B, S) = ({B}, {S}), got {tuple(self._valid.shape)}. "
                             "Pass one flag per key of every sequence in the batch.")

    def bind(self, L, S):
        valid = self._valid
        return lambda b, h, q, kv: valid.to(kv.device)[b, kv]

    def flex_mask_mod_on(self, L, S, device):
        if device is None:
            return self.flex_mask_mod(L, S)
        valid = self._valid.to(device)
        return lambda b, h, q, kv: valid[b, kv]

    def tile_kinds(self, B, H, L, S, bm, bn):
        v = self._valid.to(torch.int8)
        lo, hi = _tiling.block_minmax(v, bn)  # (B, nk): all valid -> min 1, none valid -> max 0
        nq = -(-L // bm)
        return kinds_from((lo == 1).view(-1, 1, 1, lo.shape[1]).expand(-1, 1, nq, -1),
                          (hi == 0).view(-1, 1, 1, hi.shape[1]).expand(-1, 1, nq, -1))

    def key_span(self, B, H, L, S):
        live = self._valid.any(0).nonzero()
        return (0, 0) if live.numel() == 0 else (int(live[0]), int(live[-1]) + 1)

    def decode_tile(self, B, L, S, device):
        if self.batch_size != B or self._valid.shape[1] != S or not self._every_row_sees_a_key:
            return None
        key = str(device)
        if key not in self._on:
            self._on[key] = self._valid.to(device).view(B, 1, 1, S)
        return 0, S, self._on[key]

    def _natural_size(self):
        S = int(self._valid.shape[1])
        return (S, S)

    def row_intervals(self, B, L, S):
        valid = self._valid  # (B, S)
        first = torch.where(valid.any(1), valid.int().argmax(1), S)
        last = S - valid.flip(1).int().argmax(1)  # one past the last valid key
        n = valid.sum(1)
        if bool((n > 0).any()) and not bool(((last - first == n) | (n == 0)).all()):
            return None  # a hole inside some row's valid keys
        lo, hi = torch.where(n > 0, first, 0), torch.where(n > 0, last, 0)
        return _intervals(lo.view(-1, 1).expand(-1, L), hi.view(-1, 1).expand(-1, L), S)

    def __repr__(self):
        return f"key_padding(<{tuple(self._valid.shape)} flags>)"


class Chunked(Mask):
    """Chunked causal attention (Llama 4's local layers): the query at key position
    ``p = i + offset`` sees keys ``j <= p`` in its own chunk, ``j // size == p // size``."""

    same_for_every_head = True

    def __init__(self, size: int, align: str = "bottom_right"):
        self.size = _check_int("size", size, 1)
        if self.size > _MAX_SIZE:  # torch's int64 division of the mask's own mod would overflow
            raise ValueError(f"size: expected an int <= 2**62, got {size}. A chunk longer than any sequence is "
                             "plain causal: pass masks.causal().")
        self.align = _check_align(align)

    def bind(self, L, S):
        off, c = _offset(self.align, L, S), self.size
        return lambda b, h, q, kv: (kv <= q + off) & (torch.div(kv, c, rounding_mode="floor")
                                                      == torch.div(q + off, c, rounding_mode="floor"))

    def cache_key(self):
        return ("chunked", self.size, self.align)

    def tile_kinds(self, B, H, L, S, bm, bn):
        return self._kinds_counted(B, H, L, S, bm, bn)[0]

    def _kinds_counted(self, B, H, L, S, bm, bn):
        # its own mod by range evaluation: O(tiles), exact (the tiles the ranges leave undecided,
        # those crossing the diagonal or a chunk edge, are settled at their points)
        return _range_kinds(self.bind(L, S), 1, 1, L, S, bm, bn)

    def key_span(self, B, H, L, S):
        off, c = _offset(self.align, L, S), self.size
        return max(0, (off // c) * c), max(0, min(S, L + off))

    def decode_tile(self, B, L, S, device):
        off, c = _offset(self.align, L, S), self.size
        if off < 0 or L > S:
            return None
        j0, j1 = (off // c) * c, min(S, L + off)
        p = torch.arange(off, off + L, device=device).view(L, 1)
        j = torch.arange(j0, j1, device=device).view(1, -1)
        return j0, j1, (j <= p) & (torch.div(j, c, rounding_mode="floor") == torch.div(p, c, rounding_mode="floor"))

    def row_intervals(self, B, L, S):
        return _intervals(*self._row_edges(L, S), S)

    def _row_edges(self, L: int, S) -> tuple[np.ndarray, np.ndarray]:
        p = _positions(L, _offset(self.align, L, S))
        size = _cap(self.size, L, S)
        return p // size * size, p + 1

    def __repr__(self):
        return f"chunked({self.size}, align={self.align!r})"


class Document(Mask):
    """Packed sequences: attend only within the same document id.

    ``doc_ids`` has shape ``(S,)`` (shared by the batch) or ``(B, S)``. Query
    row ``i`` belongs to the document of key position ``i + S - L``. The ids are a private
    copy; reading ``m.doc_ids`` gives a copy (changing it changes nothing).
    """

    same_for_every_head = True

    doc_ids = property(lambda self: self._doc_ids.clone(), doc="(S,) or (B, S) ids (a copy).")

    def __init__(self, doc_ids):
        self._doc_ids = _int_vector("doc_ids", doc_ids, ndim_ok=(1, 2))
        self.batch_size = int(self._doc_ids.shape[0]) if self._doc_ids.dim() == 2 else None

    def validate(self, B, H, L, S):
        super().validate(B, H, L, S)
        if self._doc_ids.shape[-1] != S:
            raise ValueError(
                f"doc_ids: expected one id per key position (S={S}), got {self._doc_ids.shape[-1]}. "
                "Pass ids of shape (S,) or (B, S)."
            )
        if L > S:
            raise ValueError(f"document mask: needs L <= S (queries aligned to the last L keys), got L={L}, S={S}.")

    def _ids2d(self) -> torch.Tensor:
        return self._doc_ids if self._doc_ids.dim() == 2 else self._doc_ids.unsqueeze(0)

    def bind(self, L, S):
        ids, off = self._ids2d(), S - L
        if ids.shape[0] == 1:
            return lambda b, h, q, kv: ids[0].to(kv.device)[q + off] == ids[0].to(kv.device)[kv]
        return lambda b, h, q, kv: ids.to(kv.device)[b, q + off] == ids.to(kv.device)[b, kv]

    def flex_mask_mod_on(self, L, S, device):
        if device is None:
            return self.flex_mask_mod(L, S)
        ids, off = self._ids2d().to(device), S - L
        if ids.shape[0] == 1:
            row = ids[0]
            return lambda b, h, q, kv: row[q + off] == row[kv]
        return lambda b, h, q, kv: ids[b, q + off] == ids[b, kv]

    def tile_kinds(self, B, H, L, S, bm, bn):
        # per id row: a tile is full when its query and key blocks hold one and the same id,
        # empty when their id ranges do not overlap, partial otherwise (conservative)
        ids, off = self._ids2d(), S - L
        qmin, qmax = _tiling.block_minmax(ids[:, off:off + L], bm)  # (Bi, nq)
        kmin, kmax = _tiling.block_minmax(ids, bn)  # (Bi, nk)
        empty = (qmax[:, :, None] < kmin[:, None, :]) | (qmin[:, :, None] > kmax[:, None, :])
        full = ((qmin == qmax)[:, :, None] & (kmin == kmax)[:, None, :]
                & (qmin[:, :, None] == kmin[:, None, :]))
        return kinds_from(full, empty).unsqueeze(1)  # (Bi, 1, nq, nk)

    def _natural_size(self):
        S = int(self._doc_ids.shape[-1])
        return (S, S)

    def row_intervals(self, B, L, S):
        ids = self._ids2d()  # (Bi, S)
        new = torch.ones_like(ids, dtype=torch.bool)
        new[:, 1:] = ids[:, 1:] != ids[:, :-1]  # a run of equal ids starts here
        runs = new.sum(1)
        if any(int(r) != int(torch.unique(row).numel()) for r, row in zip(runs, ids, strict=True)):
            return None  # some document is split into several runs: not one stretch per row
        pos = torch.arange(S).expand_as(ids)
        start = torch.cummax(torch.where(new, pos, 0), 1).values
        end_new = torch.ones_like(new)
        end_new[:, :-1] = new[:, 1:]  # a run ends here
        end = torch.flip(torch.cummin(torch.flip(torch.where(end_new, pos + 1, S), [1]), 1).values, [1])
        return _intervals(start[:, S - L:], end[:, S - L:], S)

    def __repr__(self):
        return f"document(<{tuple(self._doc_ids.shape)} ids>)"


class PrefixLM(Mask):
    """The first ``prefix_length`` keys are visible to every query; causal (bottom-right) elsewhere."""

    same_for_every_head = True

    def __init__(self, prefix_length: int):
        self.prefix_length = _check_int("prefix_length", prefix_length, 0)

    def cache_key(self):
        return ("prefix_lm", self.prefix_length)

    def validate(self, B, H, L, S):
        if self.prefix_length > S:
            raise ValueError(f"prefix_length: expected <= S={S}, got {self.prefix_length}.")

    def bind(self, L, S):
        off, p = S - L, self.prefix_length
        return lambda b, h, q, kv: (kv < p) | (kv <= q + off)

    def tile_kinds(self, B, H, L, S, bm, bn):
        klo, khi = edges(S, bn)
        p, nq = self.prefix_length, -(-L // bm)
        prefix = kinds_from((khi < p).view(1, 1, 1, -1).expand(1, 1, nq, -1),
                            (klo >= p).view(1, 1, 1, -1).expand(1, 1, nq, -1))
        return torch.maximum(prefix, _band_kinds(S - L, None, L, S, bm, bn))

    def row_intervals(self, B, L, S):
        return _intervals(*self._row_edges(L, S), S)

    def _row_edges(self, L: int, S) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((1, L), np.int64), np.maximum(_positions(L, S - L) + 1, self.prefix_length)

    def __repr__(self):
        return f"prefix_lm({self.prefix_length})"


class FromMod(Mask):
    """A user ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (FlexAttention signature).

    Its tiles come from range evaluation (:mod:`attnkit._ranges`): one call over per-tile index
    intervals, then points only on the tiles the intervals leave undecided; every point when
    the mod does something intervals do not follow (see ``_kinds_counted``)."""

    def cache_key(self):
        # A function reading data that may change between calls (the next batch's document
        # ids in a tensor it closes over) has no key: it is evaluated afresh on every call.
        # Hold an attnkit.plan(...) to reuse its evaluation explicitly.
        k = _mods.value_key(self.fn)
        return None if k is None else ("from_mod", k)

    def __init__(self, fn: MaskMod):
        if not callable(fn):
            raise TypeError(
                f"mask_mod: expected a callable (b, h, q_idx, kv_idx) -> bool tensor, got {type(fn).__name__}.")
        n = _mods.positional_arity(fn)  # FlexAttention's count: parameters with defaults do not count
        if n is not None and n != 4:
            raise TypeError(
                f"mask_mod: expected a function of 4 arguments (b, h, q_idx, kv_idx), got one of {n} "
                "(parameters with a default value are not counted). "
                + (_mods.uncalled(fn) or "Did you pass a score_mod (5 arguments) as the mask?")
            )
        self.fn = fn

    def validate(self, B, H, L, S):
        # Evaluate once on index 0 so a mask_mod returning non-bool fails here,
        # at the boundary, not as a silently wrong bitwise ``~`` inside a backend.
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        out = self.bind(L, S)(zero, zero, zero, zero)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = type(out).__name__ if not isinstance(out, torch.Tensor) else f"a tensor of {out.dtype}"
            raise TypeError(
                f"mask_mod {getattr(self.fn, '__name__', '')!r} must return a bool tensor (True = attend), "
                f"got {got}. Use comparisons and &, |, ~ on the index tensors."
            )

    def bind(self, L, S):
        # Broadcasting evaluation where it equals FlexAttention's per-scalar (vmap) one;
        # vmap otherwise (chained indexing such as bias[b][q_idx]). See attnkit._mods.
        fn = self.fn
        return lambda b, h, q, kv: _mods.eval_mask_mod(fn, b, h, q, kv, (b.numel(), h.numel(), L, S))

    def flex_mask_mod(self, L, S):
        return self.fn  # FlexAttention evaluates it its own way (vmap)

    def points_mod(self, B, H, L, S):
        fn = self.fn
        if _mods.broadcast_safe(fn, False, B, H, L, S):
            return fn
        pointwise = torch.vmap(fn)  # scalar semantics: one point per lane, any arrangement of points

        def mod(b, h, q, kv):
            shape = torch.broadcast_shapes(b.shape, h.shape, q.shape, kv.shape)
            return pointwise(*(t.expand(shape).reshape(-1) for t in (b, h, q, kv))).reshape(shape)

        return mod

    def tile_kinds(self, B, H, L, S, bm, bn):
        return self._kinds_counted(B, H, L, S, bm, bn)[0]

    def _kinds_counted(self, B, H, L, S, bm, bn):
        """Range evaluation first (one call over every tile; points only where undecided), for a
        mod evaluated by broadcasting; every point otherwise (a vmap-only mod, or one doing
        something intervals do not follow: Python ``if`` on an index, ``.item()``, ...)."""
        if small_grid(B, H, L, S):  # a decode step's few points: all, at once
            kinds = _small_grid_kinds(self.bind(L, S), B, H, L, S, bm, bn)
            return kinds, kinds.numel()
        if _mods.broadcast_safe(self.fn, False, B, H, L, S):
            try:
                return _range_kinds(self.fn, B, H, L, S, bm, bn)
            except _ranges.Unsupported:
                pass
        kinds = _evaluated_kinds(self.bind(L, S), B, H, L, S, bm, bn)
        return kinds, kinds.numel()

    def __repr__(self):
        return f"from_mod({getattr(self.fn, '__name__', 'mask_mod')})"


# The built-in masks: immutable values with closed forms (row intervals, decode tiles, tile kinds); a user's
# mask_mod (FromMod) and the combinators are evaluated instead
BUILT_IN = frozenset((Full, Causal, SlidingWindow, Padding, KeyPadding, Chunked, Document, PrefixLM))


class _Combined(Mask):
    def __init__(self, *parts: Mask):
        self.parts = parts
        sizes = {p.batch_size for p in parts if p.batch_size is not None}
        if len(sizes) > 1:
            raise ValueError(f"mask: cannot combine masks built for different batch sizes {sorted(sizes)}.")
        self.batch_size = sizes.pop() if sizes else None

    def _natural_size(self):
        return next((n for n in (p._natural_size() for p in self.parts) if n is not None), None)

    @property
    def same_for_every_head(self) -> bool:  # type: ignore[override]  # (&, |, ~ of parts that each are)
        return all(p.same_for_every_head for p in self.parts)

    def cache_key(self):
        keys = tuple(p.cache_key() for p in self.parts)
        return None if any(k is None for k in keys) else (type(self).__name__, keys)

    def validate(self, B, H, L, S):
        for p in self.parts:
            p.validate(B, H, L, S)


def _fold(mods, op):
    """One mask_mod combining ``mods`` with ``op`` (``&`` or ``|``), left to right."""
    def mod(b, h, q, kv):
        out = mods[0](b, h, q, kv)
        for m in mods[1:]:
            out = op(out, m(b, h, q, kv))
        return out

    return mod


class _Fold(_Combined):
    """A mask combining its parts pointwise with ``_op`` and their tile kinds with ``_kinds``."""

    # set by each subclass (And, Or)
    _op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # pointwise: a & b, a | b
    _kinds: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # tile kinds: min, max
    _sym: str

    def tile_kinds(self, B, H, L, S, bm, bn):
        return self._kinds_counted(B, H, L, S, bm, bn)[0]

    def _kinds_counted(self, B, H, L, S, bm, bn):
        out, n = self.parts[0]._kinds_counted(B, H, L, S, bm, bn)
        for p in self.parts[1:]:
            k, m = p._kinds_counted(B, H, L, S, bm, bn)
            out, n = self._kinds(out, k), n + m
        return out, n

    def flex_mask_mod(self, L, S):
        return _fold([p.flex_mask_mod(L, S) for p in self.parts], self._op)

    def flex_mask_mod_on(self, L, S, device):
        return _fold([p.flex_mask_mod_on(L, S, device) for p in self.parts], self._op)

    def bind(self, L, S):
        return _fold([p.bind(L, S) for p in self.parts], self._op)

    def points_mod(self, B, H, L, S):
        return _fold([p.points_mod(B, H, L, S) for p in self.parts], self._op)

    def __repr__(self):
        return "(" + f" {self._sym} ".join(map(repr, self.parts)) + ")"


class And(_Fold):
    """Both allow: tile kinds combine by min (EMPTY < PARTIAL < FULL)."""

    _op, _kinds, _sym = staticmethod(lambda a, b: a & b), staticmethod(torch.minimum), "&"

    def decode_tile(self, B, L, S, device):
        """The intersection of the parts' decode tiles, when every part offers one and no row is left empty."""
        maybe = [p.decode_tile(B, L, S, device) for p in self.parts]
        tiles = [t for t in maybe if t is not None]
        if len(tiles) != len(maybe):
            return None
        j0, j1 = max(t[0] for t in tiles), min(t[1] for t in tiles)
        if j1 <= j0:
            return None
        allowed = tiles[0][2][..., j0 - tiles[0][0]:j1 - tiles[0][0]]
        for tj0, _, a in tiles[1:]:
            allowed = allowed & a[..., j0 - tj0:j1 - tj0]
        if not bool(allowed.any(-1).all()):
            return None
        return j0, j1, allowed

    def row_intervals(self, B, L, S):
        """The intersection of the parts' stretches (one stretch too), when every part has them."""
        lo: torch.Tensor | None = None
        hi: torch.Tensor | None = None
        for p in self.parts:
            iv = p.row_intervals(B, L, S)
            if iv is None:
                return None
            if lo is None or hi is None:
                lo, hi = iv
            else:
                lo, hi = torch.maximum(lo, iv[0]), torch.minimum(hi, iv[1])
        if lo is None or hi is None:
            return None
        return lo.contiguous(), hi.contiguous()


class Or(_Fold):
    """Either allows: tile kinds combine by max."""

    _op, _kinds, _sym = staticmethod(lambda a, b: a | b), staticmethod(torch.maximum), "|"


class Not(_Combined):
    def __init__(self, inner: Mask):
        super().__init__(inner)
        self.inner = inner

    def bind(self, L, S):
        mod = self.inner.bind(L, S)
        return lambda b, h, q, kv: ~mod(b, h, q, kv)

    def flex_mask_mod(self, L, S):
        mod = self.inner.flex_mask_mod(L, S)
        return lambda b, h, q, kv: ~mod(b, h, q, kv)

    def flex_mask_mod_on(self, L, S, device):
        mod = self.inner.flex_mask_mod_on(L, S, device)
        return lambda b, h, q, kv: ~mod(b, h, q, kv)

    def points_mod(self, B, H, L, S):
        mod = self.inner.points_mod(B, H, L, S)
        return lambda b, h, q, kv: ~mod(b, h, q, kv)

    def tile_kinds(self, B, H, L, S, bm, bn):
        return self._kinds_counted(B, H, L, S, bm, bn)[0]

    def _kinds_counted(self, B, H, L, S, bm, bn):
        k, n = self.inner._kinds_counted(B, H, L, S, bm, bn)
        return (FULL - k).to(torch.int8), n  # swaps EMPTY and FULL

    def __repr__(self):
        return f"~{self.inner!r}"


def full() -> Mask:
    """No masking: every query sees every key."""
    return Full()


def causal(align: str = "bottom_right") -> Mask:
    """Look-ahead mask. ``align="bottom_right"`` (default): query ``i`` sees keys
    ``j <= i + S - L``; ``"top_left"``: keys ``j <= i``. See the module docstring."""
    return Causal(align)


def sliding_window(size: int, align: str = "bottom_right") -> Mask:
    """Each query sees itself and the ``size - 1`` keys before it (causal local attention).

    For L = S = 5, size = 2::

            k0 k1 k2 k3 k4
        q0   #  .  .  .  .
        q1   #  #  .  .  .
        q2   .  #  #  .  .
        q3   .  .  #  #  .
        q4   .  .  .  #  #
    """
    return SlidingWindow(size, align)


def padding(key_lengths) -> Mask:
    """Per batch row ``b``, keys ``j < key_lengths[b]`` are visible. ``key_lengths``: ``(B,)`` ints."""
    return Padding(key_lengths)


def key_padding(valid) -> Mask:
    """Per batch row, the keys flagged True in ``valid`` (bool ``(B, S)``) are visible: any
    padding pattern, e.g. left padding for generation (``padding`` is right padding).

    valid = [[False, True, True]] (one pad token on the left)::

            k0 k1 k2
        q0   .  #  #
    """
    return KeyPadding(valid)


def chunked(size: int, align: str = "bottom_right") -> Mask:
    """Chunked causal attention: each query sees the keys before it in its own chunk of ``size``.

    For L = S = 5, size = 2::

            k0 k1 k2 k3 k4
        q0   #  .  .  .  .
        q1   #  #  .  .  .
        q2   .  .  #  .  .
        q3   .  .  #  #  .
        q4   .  .  .  .  #
    """
    return Chunked(size, align)


def document(doc_ids) -> Mask:
    """Packed sequences attend within their document. ``doc_ids``: ``(S,)`` or ``(B, S)`` ints.

    doc_ids = [0, 0, 1, 1, 1]::

            k0 k1 k2 k3 k4
        q0   #  #  .  .  .
        q1   #  #  .  .  .
        q2   .  .  #  #  #
        q3   .  .  #  #  #
        q4   .  .  #  #  #

    Combine with ``causal()`` for packed causal language modelling.
    """
    return Document(doc_ids)


def prefix_lm(prefix_length: int) -> Mask:
    """Keys ``j < prefix_length`` are visible to all queries; causal (bottom-right) after.

    prefix_length = 2, L = S = 4::

            k0 k1 k2 k3
        q0   #  #  .  .
        q1   #  #  .  .
        q2   #  #  #  .
        q3   #  #  #  #
    """
    return PrefixLM(prefix_length)


def from_mod(mask_mod: MaskMod) -> Mask:
    """Wrap a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``.

    Example: ``from_mod(lambda b, h, q, kv: (q - kv).abs() <= 2)`` (a band).
    The function must work on broadcasting index tensors, not only on ints.
    """
    return FromMod(mask_mod)
