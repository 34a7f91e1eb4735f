"""What every backend receives: the ``Request`` built by the one validation point (``attnkit._request``).

Its tensors are 4-D torch tensors of one floating dtype on one device, and the mask is
resolved into at most three parts that are ANDed together:

* ``mask``       a structured :class:`attnkit.masks.Mask` (causal folded in);
* ``dense_mask`` a user bool tensor, 4-D, broadcastable to ``(B, H, L, S)``;
* ``bias``       a user float tensor added to the scaled scores, same shape rule.

Each declared kernel (``_kernel.Kernel``) answers ``not_supported(req)`` and ``run(req) ->
(out, lse | None)``; ``attnkit._dispatch`` walks the device's table (``_table``) and
``attnkit.api`` runs the kernel it chose.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import masks as _masks

if TYPE_CHECKING:
    from ..plans import BlockPlan

__all__ = ["Request"]


@dataclass
class Request:
    q: torch.Tensor  # (B, H, L, D)
    k: torch.Tensor  # (B, Hkv, S, D)
    v: torch.Tensor  # (B, Hkv, S, Dv)
    scale: float
    mask: _masks.Mask | None = None
    dense_mask: torch.Tensor | None = None  # bool, 4-D, broadcastable to (B, H, L, S)
    bias: torch.Tensor | None = None  # float, 4-D, broadcastable to (B, H, L, S)
    score_mod: Callable | None = None
    dropout_p: float = 0.0
    causal: bool = False  # True when ``mask`` is exactly one causal mask (SDPA's is_causal)
    causal_align: str = "bottom_right"
    need_lse: bool = False  # the backend must return lse (asked for, or needed for weights / sinks)
    return_lse: bool = False  # the caller asked for lse
    weight_heads: list | None = None  # heads whose exact weights are returned (None: no weights)
    sinks: torch.Tensor | None = None  # per-head sink logits, broadcastable to (B, H, L)
    plan: BlockPlan | None = None  # an explicit attnkit.plans.BlockPlan the caller passed as mask=
    plan_extra: _masks.Mask | None = None  # causal mask added on top of that plan (causal=True)
    # Tensors the score_mod reads that require grad (its own for attnkit's ScoreMods; found in
    # the closure, defaults and globals of any other function). Backends that accept a call
    # return gradients into them; ``grad_hidden`` says the mod reads a tensor requiring grad
    # that attnkit could not find, which only a backend differentiating through the whole
    # computation (eager) can honour.
    grad_tensors: list = field(default_factory=list)
    grad_hidden: bool = False
    # bookkeeping for the public boundary
    input_rank: int = 4
    numpy_in: bool = False
    # Per-call memo (e.g. the tile summary of a user bool mask, shared by auto's look at it
    # and the tiled run). It lives and dies with this request, so it can never be stale.
    memo: dict = field(default_factory=dict)

    @property
    def shape(self):
        B, H, L, D = self.q.shape
        return B, H, L, self.k.shape[2], D, self.v.shape[3], self.k.shape[1]

    @property
    def device_type(self) -> str:
        """The device whose kernel table decides: q's (``"cpu"``, ``"cuda"``), or the one
        ``attnkit._dispatch.auto_backend`` was asked to read the table of."""
        return self.memo.get("device_type") or self.q.device.type

    @property
    def has_mask(self) -> bool:
        return self.mask is not None or self.dense_mask is not None or self.bias is not None

    def requires_grad(self) -> bool:
        """Whether any gradient is wanted: of q, k, v, a float mask, or a tensor the score_mod reads."""
        if not torch.is_grad_enabled():
            return False
        return (any(t.requires_grad for t in (self.q, self.k, self.v))
                or (self.bias is not None and self.bias.requires_grad)
                or bool(self.grad_tensors) or self.grad_hidden)

    def extra_grads(self) -> bool:
        """Whether gradients are wanted beyond q, k, v (into a float mask or score_mod tensors)."""
        return torch.is_grad_enabled() and ((self.bias is not None and self.bias.requires_grad)
                                            or bool(self.grad_tensors) or self.grad_hidden)

    def compute_dtype(self) -> torch.dtype:
        """fp32/fp64 compute in their own dtype; bf16/fp16 keep scores and statistics in fp32."""
        return self.q.dtype if self.q.dtype in (torch.float32, torch.float64) else torch.float32
