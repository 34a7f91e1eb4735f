"""Transformer building blocks on top of :func:`attnkit.attention`.

Shape legend: B batch, L query length, S key length, E embed dim, H query heads,
Hkv key/value heads, D = E / H head dim. Inputs are batch-first ``(B, L, E)`` (or
``(L, B, E)`` with ``batch_first=False``, torch's default layout).

* :class:`MultiHeadAttention` — self/cross attention, GQA/MQA, RoPE/ALiBi, KV cache,
  conversion to and from ``torch.nn.MultiheadAttention``.
* :class:`KVCache` — preallocated keys/values for token-by-token decoding.
* :class:`TransformerBlock` — pre-norm attention + MLP block.

Positional encodings live in :mod:`attnkit.positional`. Bool masks are True = attend.
"""

from ._block import TransformerBlock
from ._kvcache import KVCache
from ._mha import MultiHeadAttention
from ._torch_convert import to_torch

from_torch = MultiHeadAttention.from_torch  # the classmethod: one implementation, one docstring

__all__ = ["MultiHeadAttention", "KVCache", "TransformerBlock", "from_torch", "to_torch"]
