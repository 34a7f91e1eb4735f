"""What both tiled workers share for one call: sizes, the work list, the tensors to differentiate.

Shape legend: B batch, H query heads, Hkv kv heads, g = H // Hkv, L, S, D, Dv.
"""

from __future__ import annotations

import torch

from .. import masks as _masks
from .. import score_mods as _score_mods
from ._base import Request
from ._worklist import WorkList

__all__ = ["TileContext", "additive_mod", "shift_invariant"]


def additive_mod(fn) -> bool:
    """attnkit's alibi / relative_bias: ``score + f(h, q, kv)``, so ``f`` can be a bias tile."""
    return isinstance(fn, _score_mods.ScoreMod) and fn.additive


def shift_invariant(mask) -> bool:
    """True when the mask depends only on kv_idx - q_idx (its tiles repeat along the diagonal)."""
    if isinstance(mask, (_masks.Causal, _masks.SlidingWindow)):
        return True
    if isinstance(mask, (_masks.And, _masks.Or, _masks.Not)):
        return all(shift_invariant(p) for p in mask.parts)
    return False


class TileContext:
    """Sizes, compute dtype, the work list and the gradient targets of one tiled call."""

    def __init__(self, req: Request, worker: str):
        self.req = req
        self.worker = worker  # "fused" or "plain": the kernel the table chose (tiled.FLASH_RUNS / tiled.PLAIN)
        self.plan: WorkList | None = None  # set by the launcher
        # the tile shape and caller's tile map the work list was cut from (set by the launcher; the
        # backward cuts a plain work list from them when a gradient flows into lse)
        self.plan_bm_bn: tuple[int, int] = (0, 0)
        self.given: torch.Tensor | None = None
        self.schedule: list | None = None
        self.causal: tuple | None = None  # fused, causal alone: _tiled_fused.causal_pieces (set by the launcher)
        B, H, L, S, D, Dv, Hkv = req.shape
        self.B, self.H, self.L, self.S, self.D, self.Dv, self.Hkv = B, H, L, S, D, Dv, Hkv
        self.g = H // Hkv
        self.cd = req.compute_dtype()
        # The dtype torch's CPU flash kernel runs in (fused worker). fp16 runs in fp32: the kernel's
        # fp16 path has no fast GEMM on CPUs (1×4×1024×64 causal, one thread, Xeon with AMX: backward
        # 19.4 ms fp16, 14.6 ms fp32) and its backward would take delta from an fp16-rounded output
        # (issue 18, item 5). bf16 stays bf16 (AMX: forward 2.6 ms bf16 vs 6.4 ms fp32).
        self.kernel_dtype = torch.float32 if req.q.dtype == torch.float16 else req.q.dtype
        self.additive = req.score_mod is not None and additive_mod(req.score_mod)
        shift = ((req.mask is None or shift_invariant(req.mask)) and req.dense_mask is None and req.bias is None)
        # mask tiles of shift-invariant masks repeat along the diagonal: one per offset (this call only)
        self.tile_cache: dict | None = {} if shift else None
        # any other mask: tiles that _tiled_fused.schedule found exactly equal along a diagonal
        # (this call only), keyed by the group's absolute (i0, i1, j0, j1, spans)
        self.verified: dict = {}
        # gradients wanted into a float mask or tensors the score_mod reads (plain worker only)
        self.bias_grad = req.bias is not None and req.bias.requires_grad and torch.is_grad_enabled()
        self.captured = list(req.grad_tensors) if torch.is_grad_enabled() else []

    @property
    def fused(self) -> bool:
        return self.worker == "fused"

    def q_block(self, t5, i0, i1):
        """(B, Hkv, g, L, X) -> rows [i0, i1) as (B, Hkv, g·l, X): the g heads sharing a kv head
        are one GEMM's rows (GQA without copying K/V)."""
        return t5[:, :, :, i0:i1].reshape(self.B, self.Hkv, self.g * (i1 - i0), t5.shape[-1])
