"""The common call in a few attribute reads: ``attention(q, k, v)`` or ``attention(q, k, v, causal=True)``
on 4-D torch tensors, which ``auto`` sends to torch SDPA unchanged.

A decode step or a short prompt runs a kernel of 10-100 µs; the full path (``make_request`` →
``decide`` → ``backends.sdpa.run``) costs 20-40 µs of Python around it. This module answers
the common case directly, and *only* it.

Contract (this module's own checks, for the common case only; anything outside it returns ``None`` and the caller
takes the full path, so every error message, warning and decision is the full path's):

* ``q``, ``k``, ``v`` are exactly ``torch.Tensor`` (no subclass, no NumPy), 4-D, one floating
  dtype, one device (CPU or CUDA), shapes that fit: ``(B, H, L, D)``, ``(B, Hkv, S, D)``,
  ``(B, Hkv, S, Dv)`` with ``H % Hkv == 0``, ``S ≥ 1``, ``D ≥ 1``;
* no score_mod, no dropout, no lse / weights / sinks, ``backend="auto"``, ``scale`` None or a
  finite Python float/int, ``causal`` exactly True or False; not fp16 on the CPU with a gradient
  wanted (``sdpa.backward_flaw``);
* or, on the CPU with ``causal=False``, a user tensor mask that ``auto`` hands to SDPA unchanged:
  a float bias of q's dtype with no gradient wanted, or a bool mask with L ≤ ``sdpa.DECODE_MAX_L``, 2-D to 4-D,
  broadcastable to ``(B, H, L, S)`` (``_tensor_mask``); a row it masks fully gives an all-zero output row,
  which the full path then handles;
* the mask (``causal=True`` is a bottom-right ``causal()``; at most one of the two), after the
  full path's own simplification (``_request._simplify``: causal with L = 1 is no mask, a
  window as wide as S is causal), is one of:
  - none;
  - ``causal()`` with L = S, or ``causal("top_left")``: SDPA's ``is_causal`` (CPU or CUDA);
  - on the CPU with L ≤ ``sdpa.DECODE_MAX_L``: a built-in ``causal`` / ``sliding_window`` /
    ``padding`` / ``key_padding`` / ``chunked`` mask, or an ``&`` of them, whose
    ``Mask.decode_tile`` gives the ``(L, n)`` mask over the keys it can reach with no row left
    empty (what the sdpa backend builds for such a call; on CUDA ``auto`` sends these to
    FlexAttention, so the fast path leaves them alone);
* the ``attnkit`` logger is not at DEBUG (the full path logs every decision).

These are exactly the calls for which ``auto`` decides ``sdpa`` with the ``fused`` worker and
the same arguments to ``F.scaled_dot_product_attention`` (``tests/test_fast_path.py`` checks
the decision and the output against the full path). The NaN guarantee is kept: an output
with an all-zero row (torch's CPU kernel writes zeros where a row's scores hold NaN/inf) is
thrown away and the call redone on the full path, which rescans and recomputes. Nothing is
cached here (a built-in mask's decode tile is cached on the immutable mask itself).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from . import _dispatch
from . import masks as _masks
from ._request import _CAUSAL, _simplify
from .backends._decode import FOLD_MAX_L, foldable, sdpa_folded
from .backends.sdpa import DECODE_MAX_L, may_hide_nan

_T = torch.Tensor
_FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_log = logging.getLogger("attnkit")


# Built-in masks whose decode_tile is closed form (immutable values: see attnkit.masks).
MASKS = frozenset((_masks.Causal, _masks.SlidingWindow, _masks.Padding, _masks.KeyPadding, _masks.Chunked))


def attention(q, k, v, mask, causal, scale):
    """``out`` for a call inside the contract above, else None (take the full path)."""
    if type(q) is not _T or type(k) is not _T or type(v) is not _T:
        return None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    dt = q.dtype
    if dt not in _FLOATS or k.dtype != dt or v.dtype != dt:
        return None
    dev = q.device
    if k.device != dev or v.device != dev:
        return None
    B, H, L, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    Bv, Hv, Sv, _ = v.shape
    if not (B == Bk == Bv and D == Dk and S == Sv and Hkv == Hv and Hkv and H % Hkv == 0 and S and D):
        return None
    if scale is not None and ((type(scale) is not float and type(scale) is not int) or not math.isfinite(scale)):
        return None
    if _log.isEnabledFor(logging.DEBUG):
        return None
    if dt is torch.float16 and dev.type == "cpu" and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad):
        return None  # SDPA's CPU fp16 backward is inexact (sdpa.backward_flaw): the full path decides
    if type(mask) is _T:  # a user tensor mask: SDPA applies it as it is (see _tensor_mask)
        if causal is not False or dev.type != "cpu" or not _tensor_mask(mask, dt, dev, B, H, L, S):
            return None
        if mask.dtype is not torch.bool and torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad or mask.requires_grad):
            return None  # SDPA's backward is wrong on rows a bias sets to finfo.min: the full path (issue 18)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=None if scale is None else float(scale),
                                             enable_gqa=H != Hkv)
        return None if may_hide_nan(out) else out
    if causal is True:
        if mask is not None:
            return None
        mask = _CAUSAL
    elif causal is not False:
        return None
    if mask is not None:
        mask = _simplify(mask, L, S)  # the full path's simplification (e.g. causal with L = 1: no mask)
    attn_mask, is_causal = None, False
    if mask is not None:
        if type(mask) not in MASKS and type(mask) is not _masks.And:
            return None
        if type(mask) is _masks.Causal and (L == S or mask.align == "top_left"):
            is_causal = True  # SDPA's own causal mask is top-left (= bottom-right when L = S)
        else:
            if dev.type != "cpu" or L > DECODE_MAX_L:
                return None
            tile = mask.decode_tile(B, L, S, dev)
            if tile is None:
                return None
            j0, j1, attn_mask = tile
            if j1 - j0 < S:
                k, v = k.narrow(2, j0, j1 - j0), v.narrow(2, j0, j1 - j0)  # views: the keys the mask can reach
    if dev.type == "cpu" and attn_mask is None and _native_wins(dt, is_causal, mask is None, L, S):
        return None  # auto runs attnkit's compiled kernel here (faster than SDPA: _dispatch.NATIVE_*)
    sc = None if scale is None else float(scale)
    if H != Hkv and L <= FOLD_MAX_L and foldable(q, k, attn_mask, is_causal) is None:
        out = sdpa_folded(q, k, v, attn_mask, sc)  # K/V read once per group, not once per query head
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=sc,
                                             enable_gqa=H != Hkv)
    if may_hide_nan(out):
        return None  # the full path tells a hidden NaN from zero values and recomputes
    return out


def _native_wins(dt, is_causal: bool, no_mask: bool, L: int, S: int) -> bool:
    """The sizes where ``auto`` prefers attnkit's compiled kernel to SDPA for causal / no mask (the full
    path then checks the rest: kernel built, dtype, gradients)."""
    if dt is torch.float64 or not (is_causal or no_mask):
        return False
    if is_causal:
        return min(L, S) >= _dispatch.NATIVE_CAUSAL_MIN
    return L * S >= _dispatch.NATIVE_DENSE_MIN_LS


def _tensor_mask(m: torch.Tensor, dt, dev, B: int, H: int, L: int, S: int) -> bool:
    """Whether a user tensor mask is one ``auto`` hands to SDPA as it is (CPU): a float bias of
    q's dtype (any L: nothing to skip), or a bool mask at decode sizes (L ≤ 16: the tile analysis
    that could send a bigger one to ``tiled`` is the full path's); at most 4 dims that broadcast
    to ``(B, H, L, S)`` from the right, on q's device. Anything else: the full path (and its errors)."""
    if m.device != dev or m.dim() > 4 or m.dim() < 2:
        return False  # SDPA itself rejects a 1-D (S,) mask (IndexError); the full path broadcasts it
    if m.dtype is torch.bool:
        if L > DECODE_MAX_L:
            return False
    elif m.dtype != dt:
        return False
    # a 2- or 3-dim mask pairs with the trailing (S, L[, H]) only: the shorter zip is intended
    return all(got in (1, want) for got, want in zip(reversed(m.shape), (S, L, H, B), strict=False))
