"""``KVCache``: preallocated key/value buffers for incremental (token-by-token) decoding.

Shape legend: B batch, Hkv key/value heads, S cached length, D head dim, Dv value head dim.
"""

from __future__ import annotations

import weakref

import torch

from ..positional import _check_pos_int

__all__ = ["KVCache"]


def _owner_ref(owner) -> weakref.ref:
    try:
        return weakref.ref(owner)
    except TypeError:
        raise TypeError(f"owner: expected the calling layer (a torch.nn.Module), got {type(owner).__name__} "
                        f"{owner!r:.40}. Pass owner=self from the layer's forward, or leave it out.") from None


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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

    **One cache per layer.** The first module that appends owns the cache (held by a
    weak reference); another module appending raises ``ValueError`` ("each layer needs
    its own cache") instead of silently mixing two layers' keys::

        caches = [blk.new_cache(B, max_length) for blk in blocks]   # not one cache for all

    **Decode under** ``torch.no_grad()``. The buffers hold values, never autograd graph
    (they are written under ``no_grad``). A single call on an empty cache (a prefill)
    attends to its own keys/values, so it keeps its graph and can be trained through,
    even after later decoding steps. A *later* append while autograd is recording
    (grad enabled and the new keys/values require grad) raises ``RuntimeError``: its
    gradient could not reach the earlier tokens' keys/values, and silently dropping
    that part of the gradient would be wrong. To train, run the whole sequence without
    a cache (``causal=True``).
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_length: int, head_dim: int,
                 value_dim: int | None = None, *, dtype=torch.float32, device=None):
        batch_size, num_kv_heads, max_length, head_dim = (
            _check_pos_int(name, val) for name, val in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                                                        ("max_length", max_length), ("head_dim", head_dim)))
        value_dim = head_dim if value_dim is None else _check_pos_int("value_dim", value_dim)
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype: expected a floating dtype for keys and values (float16, bfloat16, float32, "
                            f"float64), got {dtype!r}. Pass e.g. dtype=torch.float32, or the layer's new_cache().")
        self.k = torch.zeros(batch_size, num_kv_heads, max_length, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch_size, num_kv_heads, max_length, value_dim, dtype=dtype, device=device)
        self.length = 0
        self._owner: weakref.ref[torch.nn.Module] | None = None  # the module that appended first

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
        """Forget every cached token and the owning layer (the buffers are kept)."""
        self.length = 0
        self._owner = None

    def check_owner(self, module) -> None:
        """Raise ``ValueError`` if another module has already appended to this cache (a live one, or one that no
        longer exists: its keys are still here)."""
        if self._owner is None:
            return
        owner = self._owner()
        if owner is None:
            raise ValueError(
                f"kv_cache: holds {self.length} tokens appended by a module that no longer exists, and "
                f"{type(module).__name__} at {id(module):#x} tried to append after them. Call cache.reset() before "
                "another layer uses it, or build a new cache (layer.new_cache(batch_size, max_length))."
            )
        if owner is not module:
            raise ValueError(
                f"kv_cache: each layer needs its own cache: this one already holds the keys of "
                f"{type(owner).__name__} at {id(owner):#x}, and {type(module).__name__} at {id(module):#x} tried to "
                f"append to it. Build one cache per layer: caches = [layer.new_cache(batch_size, max_length) "
                f"for layer in layers]."
            )

    def check_batch(self, batch_size: int) -> None:
        if batch_size != self.batch_size:
            raise ValueError(
                f"kv_cache: built for batch size {self.batch_size}, got a query with batch size {batch_size}. "
                f"Create a cache per batch with new_cache({batch_size}, max_length)."
            )

    def append(self, k: torch.Tensor, v: torch.Tensor, *, owner=None):
        """Store ``k (B, Hkv, L, D)``, ``v (B, Hkv, L, Dv)`` after the cached tokens.

        Returns the views ``k[:, :, :length]``, ``v[:, :, :length]`` of everything cached,
        including the new tokens. Raises before writing anything if they do not fit, if
        ``owner`` (the calling layer) is not the layer that appended first, or if this is
        not the first append and autograd is recording (see the class docstring).
        """
        sk, sv = self.k, self.v
        if (type(k) is torch.Tensor and type(v) is torch.Tensor and k.dim() == 4 and v.dim() == 4
                and k.shape[:2] == sk.shape[:2] and k.shape[3] == sk.shape[3] and v.shape[:3] == k.shape[:3]
                and v.shape[3] == sv.shape[3] and k.dtype == sk.dtype and v.dtype == sv.dtype
                and k.device == sk.device and v.device == sv.device and self.length + k.shape[2] <= sk.shape[2]
                and (owner is None or self._owner is None or self._owner() is owner)
                and not torch.is_grad_enabled()):
            # the decoding step under no_grad, every check below passed in one expression
            if owner is not None and self._owner is None:
                self._owner = _owner_ref(owner)  # before writing: an owner that cannot be held raises first
            start = self.length
            end = start + k.shape[2]
            sk[:, :, start:end] = k
            sv[:, :, start:end] = v
            self.length = end
            return (k, v) if start == 0 else (sk[:, :, :end], sv[:, :, :end])
        if owner is not None:
            self.check_owner(owner)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"kv_cache: expected {name} as a torch.Tensor (B, Hkv, L, D), got {type(t).__name__}. "
                    f"Convert it first, e.g. torch.as_tensor({name})."
                )
            if t.dim() != 4:
                raise ValueError(
                    f"kv_cache: expected {name} of 4 dims (B, Hkv, L, D), got shape {tuple(t.shape)}. "
                    f"Add the missing dims, e.g. {name}[None] for one sequence."
                )
        B, Hkv, L, D = k.shape
        self.check_batch(B)
        if (Hkv, D) != tuple(self.k.shape[i] for i in (1, 3)) or v.shape[:3] != k.shape[:3] \
                or v.shape[3] != self.v.shape[3]:
            raise ValueError(
                f"kv_cache: holds k {tuple(self.k.shape)} / v {tuple(self.v.shape)} (B, Hkv, max_length, D), "
                f"got new k {tuple(k.shape)}, v {tuple(v.shape)}. Each attention layer needs its own cache "
                "(layer.new_cache(...))."
            )
        if k.dtype != self.k.dtype or k.device != self.k.device or v.dtype != self.v.dtype or v.device != self.v.device:
            raise TypeError(
                f"kv_cache: holds {self.k.dtype} on {self.k.device}, got keys of {k.dtype} on {k.device} and values "
                f"of {v.dtype} on {v.device}. " + (
                    f"torch.autocast is on, so the layer's keys come in {torch.get_autocast_dtype(k.device.type)}: "
                    "build the cache inside the autocast block (new_cache then uses autocast's dtype), or "
                    f"KVCache(..., dtype={torch.get_autocast_dtype(k.device.type)})."
                    if torch.is_autocast_enabled(k.device.type) else
                    "Build the cache after moving the module (new_cache uses the module's dtype and device).")
            )
        end = self.length + L
        if end > self.max_length:
            raise ValueError(
                f"kv_cache: overflow, {self.length} cached + {L} new = {end} tokens > max_length="
                f"{self.max_length}. Create the cache with max_length >= {end} (new_cache(batch_size, "
                "max_length)); no token is dropped silently."
            )
        if self.length > 0 and torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise RuntimeError(
                f"kv_cache: decoding step with autograd recording: the cache already holds {self.length} tokens, "
                "and writing new ones in place would overwrite tensors the earlier step's graph still needs "
                "(backward() would later fail with torch's in-place modification error). Decode under "
                "`with torch.no_grad():` (or torch.inference_mode()); only a single prefill call on an empty "
                "cache keeps its graph. To train, run the whole sequence without a cache (causal=True)."
            )
        ref = _owner_ref(owner) if owner is not None and self._owner is None else None  # (raises before writing)
        first = self.length == 0
        with torch.no_grad():  # the buffers never join a graph (see the class docstring)
            self.k[:, :, self.length:end] = k
            self.v[:, :, self.length:end] = v
        self.length = end
        if ref is not None:
            self._owner = ref
        if first:  # a prefill attends to its own k, v: its graph does not see later in-place writes
            return k, v
        return self.k[:, :, :end], self.v[:, :, :end]

    def __repr__(self) -> str:
        B, Hkv, S, D = self.k.shape
        return (f"KVCache(batch_size={B}, num_kv_heads={Hkv}, length={self.length}, max_length={S}, "
                f"head_dim={D}, dtype={self.k.dtype})")
