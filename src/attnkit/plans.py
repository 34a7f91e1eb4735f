"""Block plans: which tiles of the scores a mask leaves empty, full or partial — built once, reused.

Shape legend: B batch, H query heads, L query length, S key length; a plan cuts the
``(L, S)`` scores into tiles of ``bm × bn``::

    plan = attnkit.plan(masks.causal(), L=256, S=256, block=(64, 64))
    print(plan)                     causal, L=256, S=256, tiles 64×64: 10 of 16 computed (62.5%)
                                         k0 k1 k2 k3
                                     q0   P  .  .  .        F  full: no mask evaluated
                                     q1   F  P  .  .        P  partial: mask evaluated on the tile
                                     q2   F  F  P  .        .  empty: skipped, never computed
                                     q3   F  F  F  P

    out = attnkit.attention(q, k, v, mask=plan)      # reuses the tile map: no re-planning
    bm = plan.to_block_mask()                        # FlexAttention's BlockMask, same tiles

Built-in masks give their tile map in closed form from the tile corners (no point of
the mask is evaluated); a ``mask_mod`` is evaluated ONCE over index *ranges* (one
interval per query block and key block: see :mod:`attnkit._ranges`), which decides
most tiles as empty or full, and only the tiles the ranges leave undecided are
evaluated at their points (``plan.point_tiles`` counts them; ``print(plan)`` shows it).
A plan is an immutable snapshot: an opaque ``mask_mod`` that reads data is planned with the data of that moment, as
FlexAttention's ``create_block_mask`` — build a new plan when the data changes
(attnkit never caches an opaque mod's tiles behind your back; a plan is the explicit,
visible cache). Memory is O(tiles): ``kinds`` is int8 ``(Bp, Hp, nq, nk)``, with
``Bp = 1`` / ``Hp = 1`` when the mask does not depend on the batch row / head.
"""

from __future__ import annotations

import contextlib
import ctypes
import math

import numpy as np
import torch

from . import _mods, _tiling
from . import masks as _masks
from ._args import as_int
from ._tiling import EMPTY, FULL, PARTIAL

__all__ = ["BlockPlan", "plan", "create_block_mask", "EMPTY", "PARTIAL", "FULL"]

_DEFAULT_BLOCK = (64, 64)


class BlockPlan:
    """The tile map of ``mask`` at sizes ``(B, H, L, S)`` with tiles ``block = (bm, bn)``.

    Attributes (read-only): ``mask``, ``B``, ``H``, ``L``, ``S``, ``block``, ``kinds``
    (int8 ``(Bp, Hp, nq, nk)``: 0 empty, 1 partial, 2 full), ``density`` (fraction of
    tiles computed), ``partial_fraction``, ``point_tiles`` (tiles whose mask points were
    evaluated while planning: 0 for built-in closed forms). Pass it as ``mask=`` to
    :func:`attnkit.attention`.

    A plan describes its mask as it was when planned. A ``mask_mod`` that reads a tensor (document
    ids, a window length held in a tensor) edited in place afterwards makes the plan stale: a call
    with it raises ``ValueError`` (plan again after the edit, or pass the ``mask_mod`` itself and
    attnkit plans it per call). A mod reading data its content key cannot follow (a tensor on
    another device, or over 16 MiB) cannot be checked.
    """

    __slots__ = ("_block", "_kinds", "_mask", "_mask_key", "_point_tiles", "_sizes", "_wider")
    # the slots' types (set once in __init__ through object.__setattr__: the plan is immutable)
    _mask: _masks.Mask
    _sizes: tuple[int, int, int, int]  # (B, H, L, S)
    _block: tuple[int, int]  # (bm, bn)
    _kinds: torch.Tensor  # int8 (Bp, Hp, nq, nk)
    _point_tiles: int
    _mask_key: object  # the mask's content key when it was planned (None: not checked)
    _wider: set[tuple[int, int]]  # call sizes (B, H) past the planned ones found to fit

    def __init__(self, mask: _masks.Mask, B: int, H: int, L: int, S: int, block: tuple[int, int],
                 kinds: torch.Tensor, point_tiles: int = 0, mask_key: object = None):
        object.__setattr__(self, "_point_tiles", int(point_tiles))
        object.__setattr__(self, "_mask_key", mask_key)
        object.__setattr__(self, "_mask", mask)
        object.__setattr__(self, "_sizes", (B, H, L, S))
        object.__setattr__(self, "_wider", set())
        object.__setattr__(self, "_block", block)
        kinds = kinds.clone()
        kinds.requires_grad_(False)
        object.__setattr__(self, "_kinds", kinds)

    def __setattr__(self, name, value):
        raise AttributeError("a BlockPlan is immutable: build a new one with attnkit.plan(...)")

    # an immutable value: a copy is the plan itself (copy.deepcopy of a model holding one); pickled as its parts
    # (a plan of a mask_mod pickles where the function does: one defined at a module's top level)
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (BlockPlan, (self._mask, *self._sizes, self._block, self._kinds, self._point_tiles, self._mask_key))

    mask = property(lambda self: self._mask)
    B = property(lambda self: self._sizes[0])
    H = property(lambda self: self._sizes[1])
    L = property(lambda self: self._sizes[2])
    S = property(lambda self: self._sizes[3])
    block = property(lambda self: self._block)

    @property
    def point_tiles(self) -> int:
        """How many tiles had their mask evaluated point by point when the plan was built: 0 for
        built-in masks (closed form); for a ``mask_mod``, the tiles its range evaluation left
        undecided (ideally exactly the partial ones; every tile if ranges could not be used)."""
        return self._point_tiles

    @property
    def kinds(self) -> torch.Tensor:
        """int8 ``(Bp, Hp, nq, nk)`` tile kinds (a copy: the plan itself never changes)."""
        return self._kinds.clone()

    @property
    def density(self) -> float:
        """Fraction of tiles that are computed (partial or full), over every (batch, head)."""
        k = self._kinds
        return float((k != EMPTY).float().mean()) if k.numel() else 0.0

    @property
    def partial_fraction(self) -> float:
        k = self._kinds
        return float((k == PARTIAL).float().mean()) if k.numel() else 0.0

    def collapsed(self) -> torch.Tensor:
        """``(nq, nk)`` kinds valid for every (batch, head) — what the tiled CPU backend runs."""
        return _tiling.collapse(self._kinds)

    def cache_key(self):
        """A key equal for plans of equal content (the mask's own key, the sizes and the tiles), or None where the
        mask has none (its tiles were computed from data the key cannot follow)."""
        mk = self._mask.cache_key()
        return None if mk is None else ("plan", mk, self._sizes, self._block)

    def check(self, B: int, H: int, L: int, S: int) -> None:
        """Raise ``ValueError`` unless this plan fits a call with these sizes and its mask still reads what it
        read when it was planned."""
        if self._mask_key is not None and self._mask.cache_key() != self._mask_key:
            raise ValueError(
                "mask: the data this plan's mask reads changed after attnkit.plan(...) built it (a tensor its "
                "mask_mod reads was edited in place): its tiles describe the old mask, and a call would skip or "
                f"keep the wrong tiles. Plan again after the edit — attnkit.plan(mask, L={self.L}, S={self.S}, "
                "...) — or pass the mask_mod itself as mask= (attnkit plans it per call).")
        pL, pS = self._sizes[2:]
        if (L, S) != (pL, pS):
            raise ValueError(
                f"mask: this plan was built for L={pL}, S={pS}, but the call has L={L}, S={S}. "
                f"Build one for these sizes: attnkit.plan(mask, L={L}, S={S}).")
        kB, kH = self._kinds.shape[:2]
        if kB not in (1, B) or kH not in (1, H):
            raise ValueError(
                f"mask: this plan has per-batch/head tiles for B={kB}, H={kH}, but the call has B={B}, H={H}. "
                f"Build one with attnkit.plan(mask, L={L}, S={S}, B={B}, H={H}).")
        pB, pH = self._sizes[:2]
        wB, wH = kB == 1 and B > pB, kH == 1 and H > pH
        if (wB or wH) and (B, H) not in self._wider:
            # tiles of fewer rows / heads than the call (planned with B / H None): they hold for the others only
            # where the mask does not read b / h (a mod's answer has no such dim, as its tiles are evaluated)
            shape = _masks.lead_shape(self._mask.points_mod(B, H, L, S), B if wB else 1, H if wH else 1, L, S)
            reads = [n for n, w, d in (("b", wB, shape[0]), ("h", wH, shape[1])) if w and d > 1]
            if reads:
                raise ValueError(
                    f"mask: this plan's tiles were made for B={pB}, H={pH} (attnkit.plan's B / H default to "
                    f"1), but its mask reads {' and '.join(reads)} and the call has B={B}, H={H}: other batch rows' / "
                    f"heads' tiles would be row 0's / head 0's, skipping or keeping the wrong ones. Build one for "
                    f"the call: attnkit.plan(mask, L={L}, S={S}, B={B}, H={H}).")
            self._wider.add((B, H))

    def draw(self, b: int = 0, h: int = 0, max_tiles: int = 48) -> str:
        """ASCII tile map for batch row ``b`` and head ``h``: ``F`` full, ``P`` partial, ``.`` empty."""
        k = self._kinds[min(b, self._kinds.shape[0] - 1), min(h, self._kinds.shape[1] - 1)]
        nq, nk = k.shape
        sym = {EMPTY: ".", PARTIAL: "P", FULL: "F"}
        wq, wk = len(str(nq - 1)), len(str(nk - 1)) + 1
        rows = [" " * (wq + 2) + "".join(f"k{j}".rjust(wk + 1) for j in range(min(nk, max_tiles)))]
        for i in range(min(nq, max_tiles)):
            rows.append(f"q{i:<{wq}} " + "".join(sym[int(x)].rjust(wk + 1) for x in k[i, :max_tiles]))
        if nq > max_tiles or nk > max_tiles:
            rows.append(f"(first {max_tiles} of {nq} × {nk} tiles)")
        return "\n".join(rows)

    def _summary(self) -> str:
        bm, bn = self._block
        nq, nk = self._kinds.shape[-2:]
        computed = int((self._kinds != EMPTY).sum())
        total = self._kinds.numel()
        return (f"{self._mask!r}, L={self.L}, S={self.S}, tiles {bm}×{bn} ({nq}×{nk}): "
                f"{computed} of {total} computed ({100 * self.density:.1f}%), "
                f"{int((self._kinds == PARTIAL).sum())} partial, {self._point_tiles} point-evaluated")

    def __repr__(self) -> str:
        return f"BlockPlan({self._summary()})"

    def __str__(self) -> str:
        return f"BlockPlan: {self._summary()}\n{self.draw()}"

    def _repr_html_(self) -> str | None:
        from ._display import html

        return html("plan", self)

    def to_block_mask(self, device=None):
        """FlexAttention's ``BlockMask`` for the same tiles: partial tiles → ``kv_*`` (the
        mask_mod is evaluated there), full tiles → ``full_kv_*``, empty tiles left out —
        the same block mask ``create_block_mask`` builds for this mask, without evaluating
        a built-in mask at every point. Tiles must match FlexAttention's (``block=(128, 128)``
        is its default). ``device``: where the BlockMask and the tensors its ``mask_mod`` reads
        live (a GPU's FlexAttention kernel reads them there); None: the CPU."""
        dev = None if device is None else torch.device(device)
        mod = self._mask.flex_mask_mod_on(self.L, self.S, dev)
        return _block_mask(self._kinds, self._block, self.L, self.S, mod, device=dev)


def _block_mask(kinds: torch.Tensor, block: tuple[int, int], L: int, S: int, mask_mod, device=None,
                separate_full: bool = True):
    """FlexAttention's ``BlockMask`` from int8 kinds ``(Bp, Hp, nq, nk)``, with its padding rule::

        L = 5, bm = 4: rows 4..7 of the last query block are padding (masked), so a tile that is
        full on its real rows is *partial* there (create_block_mask counts the padding):

            q0-3  F  F          q0-3  F  F
            q4    F  F    ->    q4-7  P  P      (its mask_mod runs on the real row 4)
    """
    from torch.nn.attention.flex_attention import BlockMask

    bm, bn = block
    if not separate_full:  # every non-empty block partial (mask_mod runs on all of them), no full lists, as torch
        kinds = torch.where(kinds == FULL, torch.tensor(PARTIAL, dtype=kinds.dtype), kinds)
    if kinds.is_cpu and kinds.numel() <= _TINY_MAP:  # a decode step's ten blocks: lists (NumPy's per-call costs)
        kv_num, kv_idx, full_num, full_idx, q_num, q_idx, fq_num, fq_idx = _orders_tiny(kinds, L % bm != 0, S % bn != 0)
    else:
        small = kinds.is_cpu and kinds.numel() <= _SMALL_MAP  # a few hundred blocks: NumPy (torch's per-op costs)
        k = np.array(kinds.numpy()) if small else kinds.clone()  # (a copy: kinds may be an expanded view)
        if L % bm:  # (views of k: written in place)
            last = k[..., -1, :]
            last[last == FULL] = PARTIAL
        if S % bn:
            last = k[..., :, -1]
            last[last == FULL] = PARTIAL
        partial, full = k == PARTIAL, k == FULL
        kv_num, kv_idx = _ordered(partial)
        full_num, full_idx = _ordered(full)
        # the q_* fields (each key block's query blocks) are the same ordering of the transposed map
        q_num, q_idx = _ordered(partial.swapaxes(-2, -1))
        fq_num, fq_idx = _ordered(full.swapaxes(-2, -1))
    if device is not None and torch.device(device).type != "cpu":
        kv_num, kv_idx, full_num, full_idx, q_num, q_idx, fq_num, fq_idx = (
            t.to(device) for t in (kv_num, kv_idx, full_num, full_idx, q_num, q_idx, fq_num, fq_idx))
    fulls: tuple[torch.Tensor | None, ...] = (full_num, full_idx, fq_num, fq_idx) if separate_full else (None,) * 4
    try:
        return BlockMask(seq_lengths=(L, S), BLOCK_SIZE=block, mask_mod=mask_mod,
                         kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=fulls[0], full_kv_indices=fulls[1],
                         q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=fulls[2], full_q_indices=fulls[3])
    except TypeError:  # a torch whose BlockMask takes other arguments: let it derive the q_* fields
        return BlockMask.from_kv_blocks(kv_num, kv_idx, fulls[0], fulls[1], BLOCK_SIZE=block, mask_mod=mask_mod,
                                        seq_lengths=(L, S))


_SMALL_MAP = 1 << 14  # block maps ordered with NumPy (torch's per-op cost dominates a few hundred blocks)
_TINY_MAP = 256  # and in lists (NumPy's per-call cost dominates a decode step's ten)


def _orders_tiny(kinds: torch.Tensor, ragged_rows: bool, ragged_keys: bool) -> tuple[torch.Tensor, ...]:
    """The eight index fields of a tiny map (``(Bp, Hp, nq, nk)``, at most ``_TINY_MAP`` blocks) in Python lists —
    what :func:`_ordered` gives for its partial and full blocks, then for the transposed map — with the padding
    rule of :func:`_block_mask` (``ragged_rows`` / ``ragged_keys``: the last query / key block is ragged, so none of
    its blocks is full). One int32 buffer, cut into the eight fields (each a contiguous tensor of its own bytes)."""
    Bp, Hp, nq, nk = kinds.shape
    nums: list[list[int]] = [[], [], [], []]  # kv partial, kv full, q partial, q full
    idxs: list[list[int]] = [[], [], [], []]
    for b in kinds.tolist():
        for head in b:
            if ragged_rows:  # (a copy of the row: head is ours, from tolist)
                head[-1] = [PARTIAL if x == FULL else x for x in head[-1]]
            if ragged_keys:
                for row in head:
                    row[-1] = PARTIAL if row[-1] == FULL else row[-1]
            for f, lines in ((0, head), (2, zip(*head, strict=True))):  # rows, then columns (per key block)
                for line in lines:
                    if len(line) == 1:  # (a decode step's columns: one query block each)
                        x = line[0]
                        nums[f].append(int(x == PARTIAL))
                        nums[f + 1].append(int(x == FULL))
                        idxs[f].append(0)
                        idxs[f + 1].append(0)
                        continue
                    part = [j for j, x in enumerate(line) if x == PARTIAL]
                    full = [j for j, x in enumerate(line) if x == FULL]
                    nums[f].append(len(part))
                    nums[f + 1].append(len(full))
                    idxs[f] += part + [j for j, x in enumerate(line) if x != PARTIAL]
                    idxs[f + 1] += full + [j for j, x in enumerate(line) if x != FULL]
    flat = np.array([x for part in (*nums, *idxs) for x in part], dtype=np.int32)
    shapes = ((Bp, Hp, nq), (Bp, Hp, nq), (Bp, Hp, nk), (Bp, Hp, nk),
              (Bp, Hp, nq, nk), (Bp, Hp, nq, nk), (Bp, Hp, nk, nq), (Bp, Hp, nk, nq))
    parts, at = [], 0
    for sh in shapes:
        n = math.prod(sh)
        parts.append(torch.from_numpy(flat[at:at + n].reshape(sh)))
        at += n
    kv_num, full_num, q_num, fq_num, kv_idx, full_idx, q_idx, fq_idx = parts
    return kv_num, kv_idx, full_num, full_idx, q_num, q_idx, fq_num, fq_idx


def _ordered(wanted: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num, indices)`` int32 of a bool map ``(..., n)``: per row, how many blocks are wanted and
    all n block indices with the wanted ones first, each part ascending — the order of
    ``create_block_mask``'s stable descending argsort, found in O(n) by counting::

        wanted  = [0, 1, 1, 0, 1]      wanted so far   cw = [0, 1, 2, 2, 3],  num = 3
        slot of a wanted block j:   cw[j] - 1               -> blocks 1, 2, 4 to slots 0, 1, 2
        slot of another block j:    num + (j + 1 - cw[j]) - 1 -> blocks 0, 3 to slots 3, 4
        indices = [1, 2, 4, 0, 3]
    """
    if isinstance(wanted, np.ndarray):  # (a small map, read in NumPy by the caller)
        return _ordered_np(wanted)
    n = wanted.shape[-1]
    lead = wanted.shape[:-1]
    if wanted.numel() <= _SMALL_MAP:  # a decode step's few blocks
        return _ordered_np(wanted.numpy())
    w = wanted.reshape(-1, n)  # (R, n): rows in chunks that stay in cache (1M: 8192 × 8192 blocks)
    R = w.shape[0]
    num = torch.zeros(R, dtype=torch.int32)
    idx = torch.empty(R, n, dtype=torch.int32)
    ar = torch.arange(n, dtype=torch.int32)
    step = max(1, (1 << 18) // max(n, 1))
    for r0 in range(0, R if n else 0, step):
        c = w[r0:r0 + step].contiguous()
        cw = c.to(torch.int32).cumsum(-1, dtype=torch.int32)
        cnum = cw[:, -1]
        num[r0:r0 + step] = cnum
        slot = torch.where(c, cw - 1, cnum.unsqueeze(-1) + ar - cw)
        idx[r0:r0 + step].scatter_(-1, slot.long(), ar.expand(c.shape[0], n))
    return num.view(lead), idx.view(*lead, n)


def _ordered_np(wanted: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_ordered` of a small bool map in NumPy: its stable sort of "not wanted" is that order."""
    num = np.asarray(wanted.sum(axis=-1, dtype=np.int32))  # (a 1-d map: a 0-d count, as torch's)
    idx = np.argsort(~wanted, axis=-1, kind="stable").astype(np.int32, order="C")
    return torch.from_numpy(num.copy(order="C")), torch.from_numpy(idx)


def _check_block(block) -> tuple[int, int]:
    one = as_int(block)
    pair = (one, one) if one is not None else (
        tuple(as_int(x) for x in block) if isinstance(block, (tuple, list)) and len(block) == 2 else None)
    bm, bn = pair if pair is not None else (None, None)
    if bm is None or bn is None or bm < 1 or bn < 1:
        raise ValueError(f"block: expected (bm, bn), two ints >= 1 (or one int for both), got {block!r}. "
                         "Pass e.g. block=(64, 64).")
    return bm, bn


def _check_size(name: str, value, allow_none: bool = False):
    if value is None and allow_none:
        return None
    n = as_int(value)  # a NumPy integer, a 0-d integer tensor: its value (as torch takes it)
    if n is None or n < 1:
        raise ValueError(f"{name}: expected an int >= 1{' or None' if allow_none else ''}, got {value!r}.")
    return n


def plan(mask, L: int, S: int | None = None, *, B: int | None = None, H: int | None = None,
         block=_DEFAULT_BLOCK) -> BlockPlan:
    """Build the :class:`BlockPlan` of ``mask`` for query length ``L`` and key length ``S``.

    Args:
        mask: an :mod:`attnkit.masks` mask, or a ``mask_mod(b, h, q_idx, kv_idx)``.
        L, S: query and key lengths (``S`` defaults to ``L``).
        B, H: batch size and heads, for masks that depend on them (``padding``, per-batch
            ``document``, a mod reading ``b`` or ``h``); None: 1, or the mask's own batch size.
            A plan of one row / head serves calls with more only when its mask reads neither:
            over a mod that reads ``b`` or ``h`` such a call raises, naming the sizes to plan with.
        block: tile shape ``(bm, bn)``; 64×64 is the tiled CPU backend's, 128×128 FlexAttention's.
    """
    if not isinstance(mask, _masks.Mask):
        if callable(mask):
            mask = _masks.from_mod(mask)
        else:
            raise TypeError(f"mask: expected an attnkit.masks mask or a mask_mod callable, got {type(mask).__name__}.")
    L = _check_size("L", L)
    S = L if S is None else _check_size("S", S)
    B = _check_size("B", B, allow_none=True)
    H = _check_size("H", H, allow_none=True)
    bm, bn = _check_block(block)
    B = B if B is not None else (mask.batch_size or 1)
    H = 1 if H is None else H
    mask.validate(B, H, L, S)
    kinds, point_tiles = mask._kinds_counted(B, H, L, S, bm, bn)
    nq, nk = math.ceil(L / bm), math.ceil(S / bn)
    assert kinds.shape[-2:] == (nq, nk), (kinds.shape, nq, nk)
    return BlockPlan(mask, B, H, L, S, (bm, bn), kinds, point_tiles, mask.cache_key())


def create_block_mask(mask_mod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device="cpu",
                      BLOCK_SIZE=128, _compile: bool = False, separate_full_blocks: bool = True,
                      compute_dq_write_order: bool = False, dq_kv_order: bool = True):
    """Drop-in for ``torch.nn.attention.flex_attention.create_block_mask``: the same signature and
    the same ``BlockMask``, tile for tile, built from attnkit's plan instead of every point.

    Shape legend: B batch, H heads, Q_LEN (= L) query length, KV_LEN (= S) key length; tiles of
    ``BLOCK_SIZE`` (an int, or ``(q_block, kv_block)``); ``B`` / ``H`` None mean 1 (broadcast).

    The ``mask_mod`` is range-evaluated over whole tiles (``attnkit.plan``), and only the tiles
    the ranges leave undecided are evaluated at their points: O(tiles), no ``torch.compile``
    (``_compile`` is accepted for compatibility and changes nothing). At a decode step's size
    (at most 16 query rows and 2¹⁵ points, on the CPU) the mod is evaluated once at every
    point instead, and the BlockMask keeps those points: :func:`attnkit.flex_attention` reads
    the mask off them while the block mask, the mod and what it reads are unchanged (checked
    at every call by content). The result lives on
    ``device``; its ``kv_num_blocks`` / ``kv_indices`` / ``full_kv_*`` (and the ``q_*`` fields
    FlexAttention derives from them) equal ``create_block_mask``'s, including its padding rule
    for lengths that are not a multiple of the block (a ragged edge tile is never full)::

        block_mask = attnkit.create_block_mask(lambda b, h, q, kv: doc[q] == doc[kv],
                                               None, None, 131072, 131072, device="cuda")
        out = flex_attention(q, k, v, block_mask=block_mask)

    ``separate_full_blocks=False`` lists every non-empty block as partial (``mask_mod`` runs on all of them), as
    torch's does; ``compute_dq_write_order`` / ``dq_kv_order`` add the write-order fields of torch's deterministic
    GPU backward, computed by torch itself (attnkit's CPU backward needs none).
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod: expected a callable (b, h, q_idx, kv_idx) -> bool tensor, "
                        f"got {type(mask_mod).__name__}.")
    for name, flag in (("separate_full_blocks", separate_full_blocks), ("dq_kv_order", dq_kv_order),
                       ("compute_dq_write_order", compute_dq_write_order)):
        if not isinstance(flag, bool):  # (a string "False" would read as True)
            raise ValueError(f"{name}: expected a bool (as torch's create_block_mask), got {flag!r}.")
    out = _create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, bool(separate_full_blocks))
    if compute_dq_write_order:
        from torch.nn.attention import flex_attention as _flex

        order = getattr(_flex, "_compute_dq_write_order_from_block_mask", None)
        if order is None:
            raise ValueError("compute_dq_write_order: this torch has no deterministic dQ write order to compute "
                             "(torch's create_block_mask would refuse it too). Leave it False.")
        out.dq_write_order, out.dq_write_order_full = order(out, dq_kv_order=dq_kv_order)
        out.dq_kv_order, out.dq_kv_order_spt = None, dq_kv_order
    return out


def _create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, separate_full: bool):
    b_none, h_none = B is None, H is None
    B = 1 if B is None else _check_size("B", B)
    H = 1 if H is None else _check_size("H", H)
    Q_LEN, KV_LEN = _check_size("Q_LEN", Q_LEN), _check_size("KV_LEN", KV_LEN)
    try:
        block = _check_block(BLOCK_SIZE)
    except ValueError:
        raise ValueError(f"BLOCK_SIZE: expected an int >= 1 or a tuple (q_block, kv_block) of them, "
                         f"got {BLOCK_SIZE!r}.") from None
    dev = torch.device(device)
    fm = _masks.from_mod(mask_mod)
    if dev.type == "cpu" and _masks.small_grid(B, H, Q_LEN, KV_LEN):  # a decode step's: every point, once
        # B / H None (1): evaluated at 2 there, so that points of one row / head (the mod ignores b / h) hold a
        # call of any batch / heads; a mod that reads them gets its first row's blocks (as torch's) and no points
        Be, He = max(B, 2) if b_none else B, max(H, 2) if h_none else H
        small = _masks.small_grid(Be, He, Q_LEN, KV_LEN)
        points = _masks.small_grid_points(fm.bind(Q_LEN, KV_LEN), *((Be, He) if small else (B, H)), Q_LEN, KV_LEN)
        first = points[:1 if b_none else None, :1 if h_none else None]
        kinds = _masks.points_kinds(first, Q_LEN, KV_LEN, *block)
        bmask = _block_mask(kinds.expand(B, H, *kinds.shape[-2:]), block, Q_LEN, KV_LEN, mask_mod, device=dev,
                            separate_full=separate_full)
        if points.shape[:2] == first.shape[:2] or not (b_none or h_none):
            _Evaluated.attach(bmask, mask_mod, points, (Be, He) if small else (B, H))
        return bmask
    p = plan(fm, Q_LEN, KV_LEN, B=B, H=H, block=block)
    kinds = p._kinds.expand(B, H, *p._kinds.shape[-2:])  # torch's fields carry every (b, h)
    return _block_mask(kinds, block, Q_LEN, KV_LEN, mask_mod, device=dev, separate_full=separate_full)


# A compiled caller runs it eagerly (a graph break; under fullgraph=True build the block mask outside the compiled
# code): its range evaluation reads values (.item(), data-dependent branches) TorchDynamo cannot trace, and tracing it
# guarded on a module-level cache keyed by code objects, which TorchDynamo failed on
_mods.opaque_to_torch_compile(create_block_mask, "attnkit.create_block_mask plans on the host, eagerly")


_KV_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
# a call at most this big (B·H·L·S, its L a decode step's) reads a BlockMask's kept points as a bool mask; a bigger
# one (a large batch, a training step) its blocks as a plan (the tiled kernels' way)
_POINTS_MAX = 1 << 20


def _forgotten() -> None:
    """What a pickled or copied :class:`_Evaluated` becomes: nothing (the points are evaluated again)."""
    return None


class _Evaluated:
    """The points a decode step's BlockMask means, kept on it (``_attnkit_points``): those
    :func:`create_block_mask` evaluated, or those its first call read off its blocks (``_blockmask``), so that
    ``flex_attention`` reads the step's mask off them instead of turning the blocks back into a plan and evaluating
    the mod again (most of a FlexAttention decode step's cost). Trusted only while what they rest on holds,
    checked at every use (:meth:`points`): the same ``mask_mod`` with the same value key (its code and captured
    values; a CPU tensor it reads by content), the same four ``kv_*`` tensors at the same place holding the same
    bytes (an in-place edit is seen), the same block size and lengths; a call's batch rows and heads those the
    points hold (``at``: the sizes they were evaluated at; a points dim of 1 holds any size only where the mod was
    evaluated at 2 or more there and did not depend on it). Anything else (a mod without a value key, a
    BlockMask that ``.to()`` / slicing / ``_adjust`` made) goes the general way, which reads the blocks as
    FlexAttention's kernels do."""

    __slots__ = ("at", "block", "fields", "key", "layout", "mod", "rows", "seq", "snapshot", "tensor")

    def __init__(self, bmask, mod, key, points: np.ndarray | torch.Tensor, at: tuple[int, int]):
        self.mod, self.key, self.at = mod, key, at
        # (Bx, Hx, L, S), never handed to the user; each byte 0 or 1 (a mod may give a uint8 buffer viewed as bool;
        # a tensor comes from _blockmask.block_points, its bytes already so)
        self.tensor = points if isinstance(points, torch.Tensor) else \
            torch.from_numpy(np.ascontiguousarray(points).view(np.uint8) != 0)
        self.block, self.seq = tuple(bmask.BLOCK_SIZE), tuple(bmask.seq_lengths)
        self.fields = tuple(getattr(bmask, n) for n in _KV_FIELDS)
        self.layout = _layout(self.fields)
        self.snapshot = _contents(self.fields)
        self.rows = tuple(self.fields[0].shape[:2])  # the BlockMask's own (b, h) rows

    def __reduce__(self):
        # a cache on the user's BlockMask: pickling it (torch.save of a model holding one) or copying it leaves the
        # cache behind (its key holds code objects, which do not pickle); the copy evaluates its points afresh
        return _forgotten, ()

    @classmethod
    def attach(cls, bmask, mod, points: np.ndarray | torch.Tensor, at: tuple[int, int]) -> None:
        """Keep ``points`` (bool ``(Bx, Hx, L, S)``, evaluated for ``at`` = (B, H)) on ``bmask`` where its mod has a
        value key and its fields live on the CPU; else nothing."""
        key = _mods.value_key(mod)
        fields = [getattr(bmask, n) for n in _KV_FIELDS]
        if key is None or fields[0] is None or not all(t is None or t.is_cpu for t in fields):
            return  # a mod reading data that may change unseen: nothing kept
        with contextlib.suppress(AttributeError):  # (a torch whose BlockMask takes no new attributes: the general way)
            bmask._attnkit_points = cls(bmask, mod, key, points, at)

    def holds(self, B: int, H: int) -> bool:
        """Whether the points hold a call of B batch rows and H heads."""
        (Bx, Hx), (Be, He) = self.tensor.shape[:2], self.at
        return (Bx == B or (Bx == 1 and Be >= 2)) and (Hx == H or (Hx == 1 and He >= 2))

    def points(self, bmask, B: int, H: int, L: int, S: int, device) -> torch.Tensor | None:
        """The bool points ``(Bx, Hx, L, S)`` where they still mean what ``bmask`` means for a call of these sizes
        on ``device`` (at most ``_POINTS_MAX`` points); None otherwise (the caller reads the blocks)."""
        Bp, Hp = self.rows
        if self.seq != (L, S) or Bp not in (1, B) or Hp not in (1, H) or getattr(device, "type", device) != "cpu" or \
                not self.holds(B, H) or B * H * L * S > _POINTS_MAX or bmask.mask_mod is not self.mod or \
                tuple(bmask.seq_lengths) != self.seq or tuple(bmask.BLOCK_SIZE) != self.block:
            return None  # (a size mismatch: the general way names it)
        fields = (bmask.kv_num_blocks, bmask.kv_indices, bmask.full_kv_num_blocks, bmask.full_kv_indices)
        if any(a is not b for a, b in zip(fields, self.fields, strict=True)) or _layout(fields) != self.layout or \
                _contents(fields) != self.snapshot or _mods.value_key(self.mod) != self.key:
            return None  # replaced, moved, edited in place, or the mod's captured values changed
        return self.tensor


def _layout(fields) -> tuple:
    """The fields' layout: data pointer, shape, strides (None kept as None)."""
    return tuple(None if t is None else (t.data_ptr(), t.shape, t.stride()) for t in fields)


def _contents(fields) -> bytes:
    """The fields' bytes, as they are now (read at each tensor's data pointer, after its layout was compared: never
    memory a ``set_`` / ``resize_`` let go; not through ``.numpy()``, which would leave the user's tensor unable to
    ``resize_``). A strided field is read off its contiguous copy."""
    out = []
    for t in fields:
        if t is not None:
            c = t if t.is_contiguous() else t.contiguous()
            out.append(ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()) if c.numel() else b"")
    return b"".join(out)
