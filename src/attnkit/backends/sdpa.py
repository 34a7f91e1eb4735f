"""``backend="sdpa"``: torch's fused ``scaled_dot_product_attention``.

It can express: no mask, causal (top-left, or bottom-right when L == S) through
``is_causal``, and any other mask as an explicit dense mask (attnkit builds the
(B, H, L, S) tensor -- O(L·S) memory, which is why ``auto`` prefers ``tiled`` for
structured masks). It cannot apply a ``score_mod``. With ``return_lse`` it calls
the CPU flash kernel directly (the public function does not return lse) and sets
lse to -inf on fully masked rows (the kernel reports 0 there).

NaN: torch's CPU kernel turns a row whose scores contain NaN into zeros, hiding
the NaN. attnkit documents that NaN propagates to the rows it touches, so inputs
that contain NaN (an O(B·H·L·D) check, negligible next to attention) are computed
by the math path of ``eager`` instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _flash_cpu, eager
from ._base import Request
from ._tiles import allowed_tile, has_nan

__all__ = ["NAME", "unsupported", "choose_worker", "run"]

NAME = "sdpa"


def unsupported(req: Request) -> str | None:
    if req.score_mod is not None:
        return "torch SDPA cannot apply a score_mod (use backend='tiled' or 'eager')"
    if req.need_lse and req.dropout_p > 0:
        return "torch SDPA cannot return lse together with dropout (use backend='eager')"
    if req.need_lse and req.q.device.type != "cpu":
        return "lse from torch SDPA is only wired for the CPU kernel here"
    if req.need_lse and req.q.shape[-1] != req.v.shape[-1]:
        return "lse from torch SDPA needs D == Dv (the CPU flash kernel's restriction)"
    if req.need_lse and not _flash_cpu.available():
        return f"lse from torch SDPA needs torch's private CPU flash kernel, unavailable here ({_flash_cpu.unavailable_reason()})"
    if req.need_lse and req.requires_grad():
        return "lse from torch SDPA comes from a private kernel without autograd here (use backend='tiled' or 'eager')"
    return None


def _is_causal_only(req: Request) -> bool:
    L, S = req.q.shape[2], req.k.shape[2]
    return (req.causal and req.dense_mask is None and req.bias is None
            and (req.causal_align == "top_left" or L == S))


def _attn_mask(req: Request):
    """Dense mask for SDPA: bool (True = attend) or float bias, or None."""
    B, H, L, S, *_ = req.shape
    allowed = None if _is_causal_only(req) else allowed_tile(req, 0, L, 0, S)
    if req.bias is None:
        return allowed
    bias = req.bias.to(req.q.dtype)
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    return bias


def choose_worker(req: Request) -> tuple[str, str]:
    """``fused``: torch's SDPA kernels; ``math``: the same formula in plain ops, for inputs
    holding NaN (torch's CPU kernel turns a row whose scores hold NaN into zeros)."""
    if has_nan(req.q, req.k, req.v):
        return "math", "NaN in q, k or v: torch's fused CPU kernel would output 0 there, plain ops propagate it"
    return "fused", "torch.nn.functional.scaled_dot_product_attention" + (
        " (lse from its CPU flash kernel)" if req.need_lse else "")


def run(req: Request, worker: str | None = None):
    B, H, L, S, D, Dv, Hkv = req.shape
    if worker is None:
        worker, _ = choose_worker(req)
    if worker == "math":  # the same formula in plain ops (see choose_worker)
        out, lse = eager.run(req)
        return out, (lse if req.need_lse else None)
    is_causal = _is_causal_only(req)
    attn_mask = _attn_mask(req)
    if not req.need_lse:
        out = F.scaled_dot_product_attention(
            req.q, req.k, req.v, attn_mask=attn_mask, dropout_p=req.dropout_p, is_causal=is_causal,
            scale=req.scale, enable_gqa=H != Hkv)
        return out, None
    k, v = req.k, req.v
    if H != Hkv:  # the private kernel has no GQA switch
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=req.q.dtype).masked_fill(~attn_mask, float("-inf"))
    # is_causal is the kernel's top-left causal: _is_causal_only allows it only then (or L == S)
    out, lse = _flash_cpu.forward(req.q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=req.scale)
    return out, lse
