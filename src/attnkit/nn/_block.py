"""``TransformerBlock``: a pre-norm Transformer layer (attention + MLP, residual connections).

Shape legend: B batch, L length, E embed dim, H heads, Hkv key/value heads.
"""

from __future__ import annotations

import torch
from torch import nn

from ..positional import _check_pos_int
from ._kvcache import KVCache
from ._mha import MultiHeadAttention

__all__ = ["TransformerBlock"]

_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


class TransformerBlock(nn.Module):
    r"""Pre-norm Transformer block (GPT-2 / Llama layout; Xiong et al. 2020)::

        x ─┬─ LayerNorm ─ MultiHeadAttention ─ Dropout ─(+)─┬─ LayerNorm ─ MLP ─ Dropout ─(+)─► (B, L, E)
           └────────────────────────────────────────────────┘└────────────────────────────────┘
        MLP: Linear(E, mlp_ratio·E) ─ activation ─ Linear(mlp_ratio·E, E)

    Args:
        embed_dim, num_heads, num_kv_heads, positional, bias: as :class:`MultiHeadAttention`.
        mlp_ratio: hidden width of the MLP as a multiple of E.
        dropout: on the attention weights and on both residual branches (training only).
        causal: default for :meth:`forward`'s ``causal``: ``True`` (a decoder block), ``False``
            (an encoder block; decoding it with a ``kv_cache`` raises), or ``None`` (the
            default): causal exactly when a ``kv_cache`` is given, as in :class:`MultiHeadAttention`.
        activation: ``"gelu"`` or ``"relu"``.
        device, dtype: as :class:`MultiHeadAttention` (torch's factory arguments).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None, mlp_ratio: int = 4,
                 dropout: float = 0.0, causal: bool | None = None, positional=None, bias: bool = True,
                 activation: str = "gelu", device=None, dtype=None):
        super().__init__()
        mlp_ratio = _check_pos_int("mlp_ratio", mlp_ratio)
        if causal is not None and not isinstance(causal, bool):
            raise TypeError(f"causal: expected True, False or None (causal when a kv_cache is used), got {causal!r}.")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation: expected one of {sorted(_ACTIVATIONS)}, got {activation!r}.")
        self.attn = MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads, bias=bias,
                                       dropout=dropout, positional=positional, device=device, dtype=dtype)
        self.causal = causal
        factory = {"device": device, "dtype": dtype}
        self.norm1 = nn.LayerNorm(embed_dim, **factory)
        self.norm2 = nn.LayerNorm(embed_dim, **factory)
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, mlp_ratio * embed_dim, bias=bias, **factory),
            _ACTIVATIONS[activation](),
            nn.Linear(mlp_ratio * embed_dim, embed_dim, bias=bias, **factory),
        )
        self.drop = nn.Dropout(dropout)

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """A new :class:`~attnkit.nn.KVCache` for this block's attention (one per block)."""
        return self.attn.new_cache(batch_size, max_length)

    def forward(self, x: torch.Tensor, *, mask=None, causal: bool | None = None, need_weights: bool = False,
                kv_cache: KVCache | None = None, context_parallel=None):
        """``x (B, L, E)`` → ``(B, L, E)``, or ``(out, weights (B, H, L, S))`` with ``need_weights``.

        ``causal=None`` uses the block's default (see the class docstring); ``mask`` and
        ``kv_cache`` go to the attention unchanged (``causal=None`` there means causal
        exactly when a cache is given, and ``causal=False`` with a cache raises; see
        :meth:`MultiHeadAttention.forward`). Each block needs its own cache (:meth:`new_cache`).
        ``context_parallel``: an :class:`attnkit.distributed.ContextParallel`; ``x`` is then this
        rank's rows ``(B, L_r, E)`` (``cp.shard(x, dim=1)``) and the attention runs across ranks.
        """
        causal = self.causal if causal is None else causal
        if context_parallel is not None and hasattr(context_parallel, "check_module"):
            context_parallel.check_module(self)  # the whole block's weights, the same on every rank (once)
        a = self.attn(self.norm1(x), mask=mask, causal=causal, need_weights=need_weights, kv_cache=kv_cache,
                      context_parallel=context_parallel)
        a, weights = a if need_weights else (a, None)
        x = x + self.drop(a)
        x = x + self.drop(self.mlp(self.norm2(x)))
        return (x, weights) if need_weights else x
