"""Decoding with grouped-query attention: the ``g`` query heads of a K/V head read K and V once.

Shape legend: B batch, H query heads, Hkv key/value heads, g = H / Hkv, L query rows (a decode
step: L ≤ :data:`FOLD_MAX_L`), S keys, D head dim, Dv value head dim.

A decode step is memory-bound: its time is the time to read K and V. torch SDPA's CPU kernel with
``enable_gqa=True`` walks each K/V head once per *query* head, so it reads K/V ``g`` times. Here the
``g`` query heads of a group become ``g·L`` rows of one call over that group's K/V head (a view of
q when its (H, L, D) dims are contiguous; a copy of q — L rows — otherwise)::

    q (B, H = Hkv·g, L, D)            folded (B, Hkv, g·L, D)        k, v (B, Hkv, S, ·): read once
       head 0 row 0 ┐                   rows 0 .. L-1     = head 0
       head 1 row 0 ├ group 0   →       rows L .. 2L-1    = head 1    ┐ against kv head 0
       ...          ┘                   ...                           ┘

The math of every row is unchanged (each row's softmax is its own), so the result is the same
function with the same error budget; autograd runs through the view (dK, dV summed over the
group's rows by SDPA's own backward). A decode mask ``(…, L, n)`` is repeated ``g`` times along
its rows; a mask that differs per head, ``is_causal`` (its diagonal would move) and CUDA (its
kernels handle GQA natively) are not folded (:func:`foldable` says why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FOLD_MAX_L", "foldable", "sdpa_folded"]

FOLD_MAX_L = 16  # the decode sizes (sdpa.DECODE_MAX_L): beyond, the kernel is compute-bound anyway
# Several query rows with a mask: the mask is repeated g times and SDPA converts it on every call, which
# costs more than reading K/V g times until K/V are large (benchmarks/decode.py, 2 threads, H = 8, Hkv = 2:
# L = 4 causal 0.67x -> 0.49x SDPA at S = 128, 0.92x -> 0.78x at L = 16, S = 2048; 1.67x faster at S = 32768)
FOLD_MASKED_MIN_S = 8192


def foldable(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool) -> str | None:
    """None when :func:`sdpa_folded` applies to this call, else the reason it does not."""
    H, L, Hkv = q.shape[1], q.shape[2], k.shape[1]
    if H == Hkv:
        return "no grouped-query heads (H = Hkv)"
    if q.device.type != "cpu":
        return f"tensors on {q.device.type} (its SDPA kernels read K/V once per group already)"
    if L > FOLD_MAX_L:
        return f"L = {L} > {FOLD_MAX_L} (compute-bound: nothing to save)"
    if is_causal:
        return "SDPA's is_causal (the folded rows would move its diagonal)"
    if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] != 1:
        return "a mask that differs per head"
    if attn_mask is not None and L > 1 and attn_mask.shape[-1] < FOLD_MASKED_MIN_S:
        return f"a mask over {attn_mask.shape[-1]} < {FOLD_MASKED_MIN_S} keys for {L} rows (repeating it costs more)"
    return None


def sdpa_folded(q, k, v, attn_mask=None, scale=None):
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, scale=scale, enable_gqa=True)`` with the
    g query heads of each K/V head folded into rows (see the module docstring); call only when
    :func:`foldable` returned None. ``attn_mask`` broadcastable to ``(B, 1, L, S)``."""
    B, H, L, D = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    qf = q.reshape(B, Hkv, g * L, D)
    if attn_mask is not None and attn_mask.shape[-2] != 1:  # rows (…, L, S) → (…, g·L, S), head-major
        reps = [1] * attn_mask.dim()
        reps[-2] = g
        attn_mask = attn_mask.repeat(*reps)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=attn_mask, scale=scale)
    return out.view(B, H, L, v.shape[-1])
