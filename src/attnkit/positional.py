"""Positional encodings. Shape legend: L sequence length, E (d_model) embedding size."""

from __future__ import annotations

import math

import torch

__all__ = ["sinusoidal"]


def sinusoidal(length: int, d_model: int, *, base: float = 10000.0, dtype=torch.float32) -> torch.Tensor:
    """The Transformer paper's encoding, ``(length, d_model)``:

        PE(pos, 2i)   = sin(pos / base^(2i / d_model))
        PE(pos, 2i+1) = cos(pos / base^(2i / d_model))

    ``i`` counts dimension *pairs*. (Seed 003's code raises base to ``2*i/d_model``
    while its ``i`` already steps by 2, doubling the exponent; for d_model = 4 the
    correct PE(1, 2) is sin(0.01) ≈ 0.0100, not sin(0.0001).)
    """
    for name, val in (("length", length), ("d_model", d_model)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name}: expected a positive int, got {val!r}.")
    if d_model % 2:
        raise ValueError(f"d_model: expected an even size (sin/cos pairs), got {d_model}.")
    pos = torch.arange(length, dtype=torch.float64).unsqueeze(1)  # (L, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # 2i = 0, 2, 4, ...
    angle = pos / base ** (two_i / d_model)  # (L, E/2)
    pe = torch.empty(length, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.to(dtype)
