"""Modules on a shard: RoPE at global positions and a transformer block with context parallelism."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .context_parallel import ContextParallel


def rope_at(rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x (..., L_r, D)`` whose rows sit at the global ``positions (L_r,)`` (any order, gaps
    allowed: a zigzag or balanced shard): ``rotary.rotate(x, positions=positions)``."""
    return rotary.rotate(x, positions=positions)


def block_forward(block, x: torch.Tensor, cp: ContextParallel, *, causal: bool | None = None) -> torch.Tensor:
    """An :class:`attnkit.nn.TransformerBlock` on this rank's rows ``x (B, L_r, E)``:
    ``block(x, causal=causal, context_parallel=cp)``."""
    return block(x, causal=causal, context_parallel=cp)
