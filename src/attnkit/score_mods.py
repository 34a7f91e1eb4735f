"""Score modifiers with FlexAttention's signature ``score_mod(score, b, h, q_idx, kv_idx)``.

They act on the *scaled* scores (after ``q kᵀ · scale``), before any bias or mask.
Indices are broadcasting integer tensors. Shape legend: H query heads.
"""

from __future__ import annotations

import math

import torch

__all__ = ["alibi", "softcap", "relative_bias"]


def _float_vector(name: str, x) -> torch.Tensor:
    t = torch.as_tensor(x)
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected floats, got dtype {t.dtype}.")
    return t


def alibi(slopes):
    """ALiBi (Press et al., 2022): ``score + slopes[h] * (kv_idx - q_idx)``.

    ``slopes``: ``(H,)`` per-head slopes (see :func:`attnkit.positional.alibi_slopes`).
    The bias is 0 on the diagonal and grows more negative with distance::

        h=0, slope=0.5:   k0   k1   k2
                     q2  -1.0 -0.5  0.0

    Pair it with ``causal=True`` as in the paper (keys after the query get a
    positive bias otherwise).
    """
    slopes = _float_vector("slopes", slopes)
    if slopes.dim() != 1:
        raise ValueError(f"slopes: expected shape (H,), got {tuple(slopes.shape)}.")

    def alibi_mod(score, b, h, q_idx, kv_idx):
        sl = slopes.to(device=score.device, dtype=score.dtype)[h]
        return score + sl * (kv_idx - q_idx).to(score.dtype)

    alibi_mod.slopes = slopes
    return alibi_mod


def softcap(cap: float):
    """Logit soft-capping (Gemma 2): ``cap * tanh(score / cap)`` keeps scores in (-cap, cap)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"cap: expected a positive finite float, got {cap!r}.")
    cap = float(cap)

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    softcap_mod.cap = cap
    return softcap_mod


def relative_bias(table):
    """Learned relative-position bias (T5-style, unbucketed): ``score + table[h, kv_idx - q_idx + R]``.

    ``table``: ``(H, 2R + 1)`` — one bias per head and relative offset in ``[-R, R]``;
    offsets beyond ``R`` are clamped to the edge entries.
    """
    table = _float_vector("table", table)
    if table.dim() != 2 or table.shape[1] % 2 != 1:
        raise ValueError(f"table: expected shape (H, 2R + 1), got {tuple(table.shape)}.")
    R = (table.shape[1] - 1) // 2

    def relative_bias_mod(score, b, h, q_idx, kv_idx):
        rel = (kv_idx - q_idx).clamp(-R, R) + R
        return score + table.to(device=score.device, dtype=score.dtype)[h, rel]

    relative_bias_mod.table = table
    return relative_bias_mod
