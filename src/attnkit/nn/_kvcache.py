"""``KVCache``: preallocated key/value buffers for incremental (token-by-token) decoding.

Shape legend: B batch, Hkv key/value heads, S cached length, D head dim, Dv value head dim.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of the tokens seen so far, for one attention layer.

    ``k (B, Hkv, max_length, D)`` and ``v (B, Hkv, max_length, Dv)`` are allocated
    once; the first ``length`` positions are valid::

        max_length = 8, length = 5, append 2 new tokens:
        k[:, :, 0:8]   [k0 k1 k2 k3 k4 .  .  .]  ->  [k0 k1 k2 k3 k4 n0 n1 .]
                                                   attention sees k[:, :, :7]

    Keys are stored *after* any rotary embedding, so a cached key is never rotated
    twice. Build one with :meth:`attnkit.nn.MultiHeadAttention.new_cache`.
    Appending past ``max_length`` raises ``ValueError`` (nothing is dropped).
    Appends write in place, so multi-step decoding is meant for inference
    (under ``torch.no_grad()``); a single prefill call keeps its autograd graph.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_length: int, head_dim: int,
                 value_dim: int | None = None, *, dtype=torch.float32, device=None):
        for name, val in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                          ("max_length", max_length), ("head_dim", head_dim)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}: expected a positive int, got {val!r}.")
        value_dim = head_dim if value_dim is None else value_dim
        self.k = torch.zeros(batch_size, num_kv_heads, max_length, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch_size, num_kv_heads, max_length, value_dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def max_length(self) -> int:
        return self.k.shape[2]

    @property
    def remaining(self) -> int:
        return self.max_length - self.length

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept)."""
        self.length = 0

    def check_batch(self, batch_size: int) -> None:
        if batch_size != self.batch_size:
            raise ValueError(
                f"kv_cache: built for batch size {self.batch_size}, got a query with batch size {batch_size}. "
                f"Create a cache per batch with new_cache({batch_size}, max_length)."
            )

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store ``k (B, Hkv, L, D)``, ``v (B, Hkv, L, Dv)`` after the cached tokens.

        Returns the views ``k[:, :, :length]``, ``v[:, :, :length]`` of everything cached,
        including the new tokens. Raises before writing anything if they do not fit.
        """
        B, Hkv, L, D = k.shape
        self.check_batch(B)
        if (Hkv, D) != tuple(self.k.shape[i] for i in (1, 3)) or v.shape[:3] != k.shape[:3] \
                or v.shape[3] != self.v.shape[3]:
            raise ValueError(
                f"kv_cache: holds k {tuple(self.k.shape)} / v {tuple(self.v.shape)} (B, Hkv, max_length, D), "
                f"got new k {tuple(k.shape)}, v {tuple(v.shape)}. Each attention layer needs its own cache "
                "(layer.new_cache(...))."
            )
        if k.dtype != self.k.dtype or k.device != self.k.device:
            raise TypeError(
                f"kv_cache: holds {self.k.dtype} on {self.k.device}, got keys of {k.dtype} on {k.device}. "
                "Build the cache after moving the module (new_cache uses the module's dtype and device)."
            )
        end = self.length + L
        if end > self.max_length:
            raise ValueError(
                f"kv_cache: overflow, {self.length} cached + {L} new = {end} tokens > max_length="
                f"{self.max_length}. Create the cache with max_length >= {end} (new_cache(batch_size, "
                "max_length)); no token is dropped silently."
            )
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def __repr__(self) -> str:
        B, Hkv, S, D = self.k.shape
        return (f"KVCache(batch_size={B}, num_kv_heads={Hkv}, length={self.length}, max_length={S}, "
                f"head_dim={D}, dtype={self.k.dtype})")
