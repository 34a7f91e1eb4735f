"""FlexAttention's ``BlockMask`` read as an attnkit :class:`~attnkit.plans.BlockPlan`.

Shape legend: B batch, H query heads, L query length, S key length; a ``BlockMask`` cuts the
``(L, S)`` scores into blocks of ``BLOCK_SIZE = (BM, BN)``.

The meaning FlexAttention's kernels give a block mask::

    attended(b, h, i, j) =  block (i // BM, j // BN) is full                        (full_kv_*)
                         or block (i // BM, j // BN) is partial and mask_mod(b, h, i, j)   (kv_*)

Used where a ``BlockMask`` arrives: ``attnkit.attention(..., mask=block_mask)`` (the request) and
``attnkit.flex_attention(..., block_mask=...)``. It sits beside the plans it builds, below both, so
neither imports the other for it.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import sys
import types
import warnings
from collections import OrderedDict

import numpy as np
import torch

from . import _mods
from . import masks as _masks
from ._tiling import EMPTY, FULL, PARTIAL, host_array
from .plans import BlockPlan, _Evaluated

__all__ = ["is_block_mask", "block_mask_plan"]

_LARGE_BLOCK = 1 << 30  # torch's block size of the "no block mask" BlockMask (_LARGE_SPARSE_BLOCK_SIZE)


def is_block_mask(obj) -> bool:
    """Whether ``obj`` is torch's ``BlockMask`` (FlexAttention is not imported when it was never loaded)."""
    flex = sys.modules.get("torch.nn.attention.flex_attention")
    return flex is not None and isinstance(obj, flex.BlockMask)


# content key of a BlockMask and the call's sizes -> its plan (or None): a model passes the same block mask to every
# layer, and a script builds it again each step; reading it costs ~0.5 ms at any size (the key: ~10 us at L = 64)
_PLANS: OrderedDict = OrderedDict()
_PLANS_MAX = 16


def _noop_mask():
    return sys.modules["torch.nn.attention.flex_attention"].noop_mask  # loaded: a BlockMask came from it


def _content_key(block_mask, B: int, H: int, L: int, S: int, device):
    """The key of what ``block_mask`` means for a call of these sizes: its block size and lengths, the
    *content* of its four index tensors (a digest taken now: an in-place edit gives a new key) and its mask_mod's
    value key; None where one of them has none (a mod reading a list or an object, tensors on a GPU)."""
    mod = block_mask.mask_mod
    if mod is None or mod is _noop_mask():
        mk: object = "noop"
    else:
        mk = _mods.value_key(mod)
        if mk is None:
            return None
    h = hashlib.blake2b(digest_size=16)  # the four tensors' bytes in one digest; their dtypes and shapes beside it
    kinds: list[tuple | None] = []
    for t in (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
              block_mask.full_kv_indices):
        if t is None:
            kinds.append(None)
            continue
        if not t.is_cpu or t.layout is not torch.strided or t.dtype.is_complex:
            return None  # a GPU BlockMask: read afresh (its tensors are not hashed on the host every call)
        t = t.detach() if t.is_contiguous() else t.detach().contiguous()
        n = t.numel() * t.element_size()
        if n > _mods.CONTENT_KEY_MAX_BYTES:
            return None
        kinds.append((t.dtype, t.shape))
        if n:
            h.update(ctypes.string_at(t.data_ptr(), n))
    return (tuple(block_mask.BLOCK_SIZE), tuple(block_mask.seq_lengths), tuple(kinds), h.digest(), mk, B, H, L, S,
            device)


def block_mask_plan(block_mask, B: int, H: int, L: int, S: int, device, arg: str) -> BlockPlan | torch.Tensor | None:
    """The :class:`BlockPlan` meaning what ``block_mask`` means to FlexAttention's kernels (None: every
    position attends). ``arg`` names the argument in messages. Remembered under the block mask's content (a few).

    A decode step's call (on the CPU, at most 16 query rows and 2¹⁵ points) gets instead the mask's bool points
    ``(Bx, Hx, L, S)`` (:func:`block_points`), which the decode entry reads off their bytes. They are kept on the
    block mask (``plans._Evaluated``, as :func:`attnkit.create_block_mask` keeps the points it evaluated) and read
    again by the next call with it — a model's next layer — while the block mask, its mod and what the mod reads
    are unchanged (checked by content at every call)."""
    if block_mask.kv_num_blocks.is_meta:  # built on the meta device: shapes only, no blocks to read
        if getattr(device, "type", device) == "meta":
            return None  # with meta q, k, v (api._on_meta): only the results' shapes are computed
        raise ValueError(f"{arg}: a BlockMask built on the meta device has no blocks to read, got one for inputs on "
                         f"{device}. Build it with device={str(device)!r}.")
    rec = getattr(block_mask, "_attnkit_points", None)
    if rec is not None:
        points = rec.points(block_mask, B, H, L, S, device)
        if points is not None:
            return points
    if getattr(device, "type", device) == "cpu" and _masks.small_grid(B, H, L, S):
        plan = _block_mask_plan(block_mask, B, H, L, S, device, arg)
        if isinstance(plan, torch.Tensor):
            _Evaluated.attach(block_mask, block_mask.mask_mod, plan, (B, H))  # (its bytes 0 / 1: kept as it is)
        return plan
    key = _content_key(block_mask, B, H, L, S, device)
    if key is not None and key in _PLANS:
        _PLANS.move_to_end(key)
        plan = _PLANS[key]
        if plan is None or plan.mask.mask_mod is None:
            return plan
        # the same tiles, around THIS block mask's mask_mod: the kept plan's is an earlier call's function, which
        # may read a tensor edited since (its key then was another content)
        m = _BlockMaskMask(plan.mask.kinds, plan.block, block_mask.mask_mod, plan.mask._kinds_key)
        return BlockPlan(m, B, H, L, S, plan.block, plan._kinds)
    plan = _block_mask_plan(block_mask, B, H, L, S, device, arg)
    if key is not None:
        _PLANS[key] = plan
        if len(_PLANS) > _PLANS_MAX:
            _PLANS.popitem(last=False)
    return plan


def _block_mask_plan(block_mask, B: int, H: int, L: int, S: int, device, arg: str
                     ) -> BlockPlan | torch.Tensor | None:
    from torch.nn.attention.flex_attention import noop_mask

    bms = tuple(block_mask.BLOCK_SIZE)
    if bms == (_LARGE_BLOCK, _LARGE_BLOCK):
        return None  # torch's "no block mask" placeholder
    mod = block_mask.mask_mod
    if getattr(mod, "__name__", "") == "_sliced_mask_mod_error":
        raise ValueError(f"{arg}: a sliced BlockMask (block_mask[b] / [:, h]) has no usable mask_mod, as torch "
                         "says too. Build the block mask for the batch rows and heads you call with.")
    seq = tuple(int(x) for x in block_mask.seq_lengths)
    if seq != (L, S):
        raise ValueError(
            f"{arg}: the BlockMask was built for (Q_LEN, KV_LEN) = {seq}, but query and key have (L, S) = "
            f"({L}, {S}) (query {L} rows, key {S} rows). Build it for these sizes: "
            f"create_block_mask(mask_mod, B, H, {L}, {S}).")
    num = block_mask.kv_num_blocks
    if num.device != torch.device(device):
        raise ValueError(f"{arg}: the BlockMask is on {num.device}, but query is on {device}. "
                         f"Move it with block_mask.to({str(device)!r}) or build it with device=.")
    Bb, Hb = num.shape[0], num.shape[1]
    if Bb not in (1, B) or Hb not in (1, H):
        raise ValueError(f"{arg}: the BlockMask has B={Bb}, H={Hb} (batch rows, heads), but query has B={B}, "
                         f"H={H}. Build it with B in (None, {B}) and H in (None, {H}).")
    bm, bn = bms
    nq, nk = math.ceil(L / bm), math.ceil(S / bn)
    if num.shape[-1] < nq:
        raise ValueError(f"{arg}: its kv_num_blocks has {num.shape[-1]} query blocks, but L={L} with "
                         f"BLOCK_SIZE={bms} needs {nq}. Build the block mask again for these sizes.")
    noop = mod is None or mod is noop_mask
    fnum, fidx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    # a decode step's few blocks in NumPy (µs, not torch's per-op costs); the same steps either way
    small = num.is_cpu and _small(block_mask.kv_indices) and (fnum is None or (fnum.is_cpu and _small(fidx)))
    dense = _dense_np if small else _dense
    partial = dense(num, block_mask.kv_indices, nq, nk)
    full = partial & False if fnum is None else dense(fnum, fidx, nq, nk)
    if bool((partial & full).any()):
        raise ValueError(f"{arg}: some blocks are listed both in kv_indices (partial) and full_kv_indices (full), "
                         "which FlexAttention's kernels would count twice. List each block once.")
    if noop:  # a partial block with no mask_mod is attended in full
        full, partial = full | partial, partial & False
        if bool(full.all()):
            return None
    if not noop and (Bb < B or Hb < H):
        _warn_blocks_of_one_row(np.asarray(partial), np.asarray(full), mod, B, H, L, S, (bm, bn), arg)
    if small and _masks.small_grid(B, H, L, S):  # a decode step's: its points, not a plan (block_points)
        points = block_points(np.asarray(partial), np.asarray(full), None if noop else mod, B, H, L, S, (bm, bn))
        if points is not None:
            return points
    kinds = torch.as_tensor(partial * PARTIAL + full * FULL + EMPTY).to(torch.int8)  # (the two are disjoint)
    m = _BlockMaskMask(kinds, (bm, bn), None if noop else mod)
    return BlockPlan(m, B, H, L, S, (bm, bn), kinds.cpu())


def _warn_blocks_of_one_row(partial: np.ndarray, full: np.ndarray, mod, B: int, H: int, L: int, S: int,
                            block: tuple[int, int], arg: str) -> None:
    """Warn when a BlockMask's blocks were made for one batch row / head (``B=None`` / ``H=None``: shape 1 there)
    but its mask_mod reads ``b`` / ``h`` and another row's or head's blocks differ where it counts: a block empty
    there that the mod would attend (skipped), or full there where the mod hides a point (attended unmasked).
    FlexAttention's kernels, and attnkit, which runs a BlockMask as they do, then answer with row 0's / head 0's
    blocks — not ``mask_mod`` (torch's eager ``flex_attention`` evaluates the mod everywhere: the two disagree).
    Partial blocks are exact (the mod decides inside them at the real b, h). Once per block mask content (plans are
    kept by content); a mod that cannot be evaluated so is not checked."""
    try:
        inner = _masks.from_mod(mod)
        shape = _masks.lead_shape(inner.bind(L, S), B if partial.shape[0] < B else 1,
                                  H if partial.shape[1] < H else 1, L, S, *block)
        if shape == (1, 1):
            return  # the mod reads neither where the blocks have one: they hold for every row and head
        true = inner.tile_kinds(B, H, L, S, *block).numpy()
    except Exception:
        return
    wrong = (~partial & ~full & (true != EMPTY)) | (full & (true != FULL))
    if not wrong.any():
        return
    reads = " and ".join(n for n, d, g in (("b", shape[0], partial.shape[0]), ("h", shape[1], partial.shape[1]))
                         if d > 1 and g == 1)
    frame: types.FrameType | None = sys._getframe(0)
    level, here = 1, os.path.dirname(__file__)
    while frame is not None and frame.f_code.co_filename.startswith(here):  # to the user's line that called attnkit
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"{arg}: the BlockMask's blocks were made for one batch row / head (built with B={partial.shape[0]}, "
        f"H={partial.shape[1]}: None means 1), but its mask_mod reads {reads}: {int(wrong.sum())} blocks of other "
        f"rows / heads (of {wrong.size}) are empty or full there where the mod says otherwise. Like FlexAttention's "
        f"kernels, attnkit skips or attends those blocks whole as row 0 / head 0 has them, so the answer is not "
        f"mask_mod's. Build the block mask with B={B}, H={H} (create_block_mask(mask_mod, {B}, {H}, {L}, {S})).",
        UserWarning, stacklevel=level)


def block_points(partial: np.ndarray, full: np.ndarray, mod, B: int, H: int, L: int, S: int,
                 block: tuple[int, int]) -> torch.Tensor | None:
    """The bool points ``(Bx, Hx, L, S)`` of a small block mask (a decode step's): every point of a full block,
    ``mod`` (evaluated once at every point; None: none) at the points of a partial block, nothing elsewhere —
    FlexAttention's meaning, read by the decode entry off the points' bytes. ``partial`` / ``full``: bool
    ``(Bb, Hb, nq, nk)``. None where the mod cannot be evaluated so (the caller reads the blocks into a plan,
    which evaluates it its own way)::

        blocks of 4, L = 1, S = 10:   full  partial  empty        mod: kv % 2 == 0
                                      F F F F  P P P P  . .   ->  █ █ █ █ █ · █ · · ·
    """
    bm, bn = block
    rows = np.arange(L) // bm
    # each key block repeated out (NumPy's fastest), unless the blocks reach far past S (a huge key block): indexed
    cols = None if full.shape[3] * bn <= 2 * S + 4096 else np.arange(S) // bn

    def spread(x):  # each block's kind over its points: (Bb, Hb, nq, nk) -> (Bb, Hb, L, S), a new array
        x = x[:, :, rows]
        return np.repeat(x, bn, axis=3)[..., :S] if cols is None else x[..., cols]

    points = spread(full)
    if partial.any():
        inside = spread(partial)
        if mod is not None:
            try:
                inside = inside & _masks.small_grid_points(_masks.from_mod(mod).bind(L, S), B, H, L, S)
            except Exception:  # a mod not evaluated so (a vmap-only one that fails, ...): the plan's way
                return None
        points = points | inside
    return torch.from_numpy(points.view(np.uint8) != 0)


_SMALL_BLOCKS = 1 << 12  # block index entries read with NumPy
_TINY_BLOCKS = 256  # and in lists
_SMALL_KINDS = 1 << 16  # block kinds looked up with NumPy, at up to this many points (a decode step's)
_SMALL_POINTS = 1 << 18


def _small(idx: torch.Tensor) -> bool:
    """Whether a block index tensor is read with NumPy (a CPU tensor of a few entries: a decode step's)."""
    return idx.is_cpu and idx.numel() <= _SMALL_BLOCKS


def _dense_np(num: torch.Tensor, idx: torch.Tensor, nq: int, nk: int) -> np.ndarray:
    """:func:`_dense` of a small CPU block list, in NumPy (µs, not torch's per-op costs); a decode step's few
    entries in lists (NumPy's per-call costs dominate ten blocks)."""
    if idx.numel() <= _TINY_BLOCKS and num.dim() == 3 and idx.dim() == 4:
        lead = num.shape[:2]
        dense = np.zeros((*lead, nq, nk), dtype=bool)
        flat = dense.reshape(-1, nk)  # (a view: rows in (b, h, query block) order)
        r = 0
        for nb, ib in zip(num.tolist(), idx.tolist(), strict=True):
            for nh, ih in zip(nb, ib, strict=True):
                for count, row in zip(nh[:nq], ih[:nq], strict=True):
                    for j in row[:max(count, 0)]:
                        if 0 <= j < nk:  # (indices past nk: none of ours)
                            flat[r, j] = True
                    r += 1
        return dense
    n, ix = host_array(num)[..., :nq], host_array(idx)[..., :nq, :]  # (the BlockMask's own fields: not .numpy())
    ok = (np.arange(ix.shape[-1]) < n[..., None]) & (ix >= 0) & (ix < nk)  # (indices past nk: none of ours)
    dense = np.zeros((*ix.shape[:-1], nk), dtype=bool)
    at = ok.nonzero()
    where = (*at[:-1], ix[ok])  # (the blocks' lead indices, then their key block)
    dense[where] = True
    return dense


def _dense(num: torch.Tensor, idx: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """bool ``(Bb, Hb, nq, nk)`` of the blocks listed by ``num (Bb, Hb, ≥nq)``, ``idx (Bb, Hb, ≥nq, K)``
    (FlexAttention's layout: per query block, the first ``num`` entries of ``idx`` are its blocks)."""
    if num.is_cpu and _small(idx):  # a decode step's few blocks
        return torch.from_numpy(_dense_np(num, idx, nq, nk))
    num, idx = num[..., :nq].long(), idx[..., :nq, :].long()
    listed = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    width = max(nk, int(idx.max()) + 1 if idx.numel() else 0)
    target = torch.where(listed & (idx >= 0), idx, width)  # entries past num go to a spare column
    out = torch.zeros(*idx.shape[:-1], width + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(-1, target, True)
    return out[..., :nk]


def _kind_at(k, block: tuple[int, int], b, h, q, kv):
    """The kind of each point's block in kinds ``k (Bb, Hb, nq, nk)`` (a torch tensor or a NumPy array, the index
    tensors of the same library): a batch row / head index only where the kinds depend on it, so the result has
    no dim the mask does not depend on (the engines read a mask tile's leading dims as its batch rows / heads)."""
    bm, bn = block
    lead = [b % k.shape[0]] if k.shape[0] > 1 else []
    k = k if k.shape[0] > 1 else k[0]
    lead += [h % k.shape[-3]] if k.shape[-3] > 1 else []
    k = k if k.shape[-3] > 1 else k[..., 0, :, :]
    at = (*lead, q // bm, kv // bn)
    return k[at]


class _BlockMaskMask(_masks.Mask):
    """A BlockMask's meaning as an attnkit mask: its full blocks, and ``mask_mod`` inside its partial ones.

    ``kinds`` int8 ``(Bb, Hb, nq, nk)`` on the BlockMask's device (Bb, Hb ∈ {1, B}, {1, H}).
    """

    def __init__(self, kinds: torch.Tensor, block: tuple[int, int], mask_mod, kinds_key=None):
        self.kinds, self.block, self.mask_mod = kinds, block, mask_mod
        self.inner = None if mask_mod is None else _masks.from_mod(mask_mod)
        # the kinds' content, taken once: they are this mask's own (built by block_mask_plan, never handed out)
        self._kinds_key = _mods.content_key(kinds) if kinds_key is None else kinds_key
        self.batch_size = kinds.shape[0] if kinds.shape[0] > 1 else None
        # the kinds as NumPy, for looking a few points up (a decode step's row: µs, not torch's per-op costs)
        self._kinds_np = kinds.numpy() if kinds.is_cpu and kinds.numel() <= _SMALL_KINDS else None

    def cache_key(self):
        # by content: the block kinds' digest and the mod's own key (its code and what it captures, numbers by
        # value, CPU tensors by a digest taken on this call: ids edited in place give a new key); None where the
        # mod reads anything else (evaluated afresh each call)
        if self.inner is None:
            return None
        inner, kinds = self.inner.cache_key(), self._kinds_key
        return None if inner is None or kinds is None else ("block_mask", kinds, self.block, inner)

    def validate(self, B, H, L, S):
        super().validate(B, H, L, S)
        if self.inner is not None:
            self.inner.validate(B, H, L, S)  # a mask_mod that does not return bool fails here

    def _lookup(self, b, h, q, kv):
        d = self.kinds.device
        return _kind_at(self.kinds, self.block, b.to(d), h.to(d), q.to(d), kv.to(d))

    def _lookup_np(self, b, h, q, kv) -> np.ndarray | None:
        """:meth:`_lookup` in NumPy where the kinds are small and the indices plain CPU tensors at a decode step's
        few points (µs, not torch's per-op costs); else None."""
        k = self._kinds_np
        if k is None or not all(type(x) is torch.Tensor and x.is_cpu for x in (b, h, q, kv)) or \
                b.numel() * h.numel() * q.numel() * kv.numel() > _SMALL_POINTS:  # (more: torch's threads)
            return None
        try:
            return _kind_at(k, self.block, b.numpy(), h.numpy(), q.numpy(), kv.numpy())
        except (RuntimeError, TypeError):  # a tensor NumPy cannot read (a functorch transform's): torch's lookup
            return None

    def _points(self, inner):
        """The mask's points on index tensors: a kind looked up per point, ``inner`` (the mod, or None) inside the
        partial blocks; in NumPy where the lookup is and the mod's answer a CPU bool tensor."""
        def mod(b, h, q, kv):
            kn = self._lookup_np(b, h, q, kv)
            r = None if inner is None else inner(b, h, q, kv)
            if kn is not None and (r is None or (type(r) is torch.Tensor and r.dtype is torch.bool and r.is_cpu)):
                return torch.from_numpy(np.asarray(kn != EMPTY if r is None else
                                                   (kn == FULL) | ((kn == PARTIAL) & host_array(r))))
            kind = torch.from_numpy(kn) if kn is not None else self._lookup(b, h, q, kv).to(q.device)
            return kind != EMPTY if r is None else (kind == FULL) | ((kind == PARTIAL) & r)

        return mod

    def bind(self, L, S):
        return self._points(None if self.inner is None else self.inner.bind(L, S))

    def within_partial(self) -> _masks.Mask | None:
        """The mask that decides the points of this BlockMask's partial blocks (its ``mask_mod``), or None
        (no mod: a partial block is attended whole). For evaluating points known to lie in partial blocks (the
        kernel's tile map) without looking each point's block up."""
        return self.inner

    def points_mod(self, B, H, L, S):
        # the inner mod's own points form (any arrangement of index tensors: the compiled kernel's tile map
        # evaluates partial tiles stacked on the batch dim), not bind's, which assumes the (b, h, q, kv) grid
        return self._points(None if self.inner is None else self.inner.points_mod(B, H, L, S))

    def flex_mask_mod(self, L, S):
        fn, lookup = self.mask_mod, self._lookup

        def mod(b, h, q, kv):  # scalar semantics, for a BlockMask with other blocks than these
            kind = lookup(b, h, q, kv)
            return (kind == FULL) if fn is None else (kind == FULL) | ((kind == PARTIAL) & fn(b, h, q, kv))

        return mod

    def tile_kinds(self, B, H, L, S, bm, bn):
        """Kinds for tiles of ``bm × bn``: the BlockMask's own for its block size; for another, a tile
        is EMPTY / FULL when every block it overlaps is, PARTIAL otherwise (2-D prefix counts)."""
        k = self.kinds.cpu()
        BM, BN = self.block
        if (bm, bn) == (BM, BN):
            return k.clone()
        r0, r1 = (torch.arange(0, L, bm) // BM), ((torch.arange(0, L, bm) + bm).clamp(max=L) - 1) // BM
        c0, c1 = (torch.arange(0, S, bn) // BN), ((torch.arange(0, S, bn) + bn).clamp(max=S) - 1) // BN
        r0, r1, c0, c1 = r0.view(-1, 1), r1.view(-1, 1) + 1, c0.view(1, -1), c1.view(1, -1) + 1

        def count(sel: torch.Tensor) -> torch.Tensor:
            p = torch.nn.functional.pad(sel.to(torch.int32).cumsum(-2).cumsum(-1), (1, 0, 1, 0))
            return p[..., r1, c1] - p[..., r0, c1] - p[..., r1, c0] + p[..., r0, c0]

        total = (r1 - r0) * (c1 - c0)
        out = torch.full((k.shape[0], k.shape[1], r0.shape[0], c0.shape[1]), PARTIAL, dtype=torch.int8)
        out[count(k == EMPTY) == total] = EMPTY
        out[count(k == FULL) == total] = FULL
        return out

    def __repr__(self):
        name = "no mask_mod" if self.mask_mod is None else getattr(self.mask_mod, "__name__", "mask_mod")
        return f"block_mask({name}, BLOCK_SIZE={self.block})"
