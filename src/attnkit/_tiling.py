"""Tile arithmetic shared by masks (their closed-form block summaries) and plans.

The scores ``(L, S)`` are cut into tiles of ``bm`` query rows × ``bn`` key columns.
Each tile gets one kind, per (batch, head) where the mask depends on them::

    EMPTY   (0)  nothing in the tile attends              -> skipped
    PARTIAL (1)  some entries attend, some may not       -> mask evaluated on the tile
    FULL    (2)  every entry attends                     -> no mask evaluation

Kinds form the lattice EMPTY < PARTIAL < FULL: ``&`` of two masks is the elementwise
min of their kinds, ``|`` the max, ``~`` swaps EMPTY and FULL. Kind tensors are int8
``(Bp, Hp, nq, nk)`` with ``Bp ∈ {1, B}``, ``Hp ∈ {1, H}`` (1: the same for every batch
row / head), like FlexAttention's BlockMask.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

__all__ = ["EMPTY", "PARTIAL", "FULL", "edges", "host_array", "kinds_from", "block_minmax", "reduce_allowed",
           "collapse"]

EMPTY, PARTIAL, FULL = 0, 1, 2


def edges(n: int, blk: int):
    """First and last (inclusive) index of each block of ``blk`` along a length ``n``."""
    lo = torch.arange(0, n, blk)
    return lo, torch.clamp(lo + blk, max=n) - 1


# a small contiguous tensor is copied out (a few µs of bytes; a DLPack view costs ~3 µs a call)
_COPY_MAX = 1 << 16
_NP_DTYPES = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
              torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16, torch.float32: np.float32,
              torch.float64: np.float64}


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as a read-only NumPy array, the tensor left as it was.

    ``Tensor.numpy()`` marks the tensor's storage non-resizable for good, so a user's mask, a BlockMask's fields or
    a model's parameter (FSDP frees a parameter's storage with ``resize_(0)``) could never be resized again after
    attnkit read it. Here a small contiguous tensor (at most ``_COPY_MAX`` bytes) is copied out at its data pointer,
    anything else viewed through DLPack (which keeps the tensor alive and leaves its storage alone); a tensor that
    requires grad is read detached, a lazily negated or conjugated view resolved first (its bytes are not its
    values). NumPy has no bf16: view such a tensor as ``torch.uint8`` / ``int16`` first."""
    if t.requires_grad:
        t = t.detach()
    if t.is_neg() or t.is_conj():  # (a lazily negated view, e.g. z.conj().imag: its bytes are not its values)
        t = t.resolve_neg().resolve_conj()
    nbytes = t.nbytes
    if 0 < nbytes <= _COPY_MAX and t.is_cpu and t.is_contiguous() and (dt := _NP_DTYPES.get(t.dtype)) is not None:
        return np.frombuffer(ctypes.string_at(t.data_ptr(), nbytes), dtype=dt).reshape(tuple(t.shape))
    x = np.from_dlpack(t)
    x.flags.writeable = False
    return x


def row_bytes(row) -> bytes | None:
    """A NumPy bool row's bytes, one per key (1 = allowed), for reading it with ``bytes.find`` / ``rfind`` /
    ``count`` (µs at a decode step's few thousand keys, where NumPy's calls cost several each); None where some
    byte is neither 0 nor 1 (a uint8 buffer viewed as bool: True to torch and NumPy, not ``1`` to a byte search)."""
    b = row.tobytes()
    return b if b.count(0) + b.count(1) == len(b) else None


def kinds_from(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """int8 kinds from two bool tensors of the same shape (empty wins over full)."""
    g = torch.full(full.shape, PARTIAL, dtype=torch.int8)
    g[full] = FULL
    g[empty] = EMPTY
    return g


def block_minmax(x: torch.Tensor, blk: int):
    """Per-block min and max over the last dim of ``x (R, n)``: two ``(R, ceil(n/blk))`` tensors."""
    n = x.shape[-1]
    pad = (-n) % blk
    if pad:
        x = torch.cat([x, x[..., -1:].expand(x.shape[0], pad)], dim=-1)
    x = x.reshape(x.shape[0], -1, blk)
    return x.amin(dim=2), x.amax(dim=2)


def _blocks(x: torch.Tensor, blk: int, dim: int) -> torch.Tensor:
    """``x`` with ``dim`` split into blocks of ``blk`` (a new dim after it), a ragged last block filled with copies
    of its last element (which changes no block's min or max)."""
    n = x.shape[dim]
    pad = (-n) % blk
    if pad:
        x = torch.cat([x, x.narrow(dim, n - 1, 1).expand(*x.shape[:dim], pad, *x.shape[dim + 1:])], dim=dim)
    shape = list(x.shape)
    shape[dim:dim + 1] = [shape[dim] // blk, blk]
    return x.reshape(shape)


def reduce_allowed(allowed: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """Kinds ``(Bp, Hp, nq', nk')`` of an evaluated 4-D bool block (True = attend); a size-1
    row or column dim gives a size-1 kind dim (broadcast). One pass over the points: the min and max of each row's
    key blocks (the contiguous dim first, read as bytes), then of each tile's rows; a tile is full where its min is
    set, empty where its max is not (it replaced an any and an all, each over the rows first: three times the time
    at L = S = 2048; ``benchmarks/compare_revisions.py --only "bool tensor"`` shows what a call gains)."""
    a = allowed.cpu().view(torch.uint8)
    lo = hi = a
    if a.shape[3] > 1:
        lo, hi = torch.aminmax(_blocks(a, bn, 3), dim=4)
    if a.shape[2] > 1:
        lo, hi = _blocks(lo, bm, 2).amin(dim=3), _blocks(hi, bm, 2).amax(dim=3)
    return kinds_from(lo.bool(), ~hi.bool())


def collapse(kinds: torch.Tensor) -> torch.Tensor:
    """``(nq, nk)`` kinds valid for every (batch, head): EMPTY only where empty for all,
    FULL only where full for all, PARTIAL otherwise."""
    if kinds.shape[0] == 1 and kinds.shape[1] == 1:
        return kinds[0, 0]
    flat = kinds.reshape(-1, *kinds.shape[-2:])
    lo, hi = flat.amin(dim=0), flat.amax(dim=0)
    return torch.where(lo == hi, lo, torch.full_like(lo, PARTIAL))
