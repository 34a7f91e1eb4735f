"""``MultiHeadAttention``: projections + :func:`attnkit.attention`, batch-first, with GQA/MQA,
RoPE/ALiBi and KV-cache decoding.

Shape legend: B batch, L query length, S key length, E embed dim, H query heads,
Hkv key/value heads, D = E / H head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import score_mods as _score_mods
from ..api import attention
from ..positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    _check_pos_int,
    alibi_slopes,
)
from . import _torch_convert
from ._kvcache import KVCache

__all__ = ["MultiHeadAttention"]

_POSITIONAL_HELP = "None, 'rope', 'alibi' or an attnkit.positional.RotaryEmbedding"


class MultiHeadAttention(nn.Module):
    r"""Multi-head attention (Vaswani et al. 2017) with grouped-query heads (GQA/MQA), batch-first.

    ::

        query (B, L, E) ─ q_proj ─► q (B, H, L, D)  ─┐
        key   (B, S, kdim) ─ k_proj ─► k (B, Hkv, S, D) ─┼─ [RoPE on q, k] ─ attnkit.attention ─► (B, H, L, D)
        value (B, S, vdim) ─ v_proj ─► v (B, Hkv, S, D) ─┘        [ALiBi as score_mod]
                                               ─ merge heads (B, L, E) ─ out_proj ─► output (B, L, E)

    Self-attention when ``key`` and ``value`` are None, or when they are the query tensor
    itself (torch's calling style ``mha(x, x, x)``); cross-attention otherwise
    (``value`` defaults to ``key``). Query head ``h`` reads key/value head
    ``h // (H // Hkv)``; ``num_kv_heads=1`` is multi-query attention (MQA)::

        H = 4, Hkv = 2:   q heads  0 1 | 2 3
                          kv head   0  |  1

    Args:
        embed_dim: E, a multiple of ``num_heads``.
        num_heads: H query heads; head dim ``D = E // H``.
        num_kv_heads: Hkv, a divisor of H (default H: plain multi-head attention).
        kdim, vdim: feature sizes of ``key`` / ``value`` for cross-attention (default E).
        bias: biases on the four projections (as torch's ``bias``).
        dropout: dropout probability on the attention weights, in training mode only.
        positional: None; ``"rope"`` (a :class:`~attnkit.positional.RotaryEmbedding` of the
            head dim) or a ``RotaryEmbedding`` instance; or ``"alibi"`` (causal ALiBi
            slopes, :func:`~attnkit.positional.alibi_slopes`; use it with ``causal=True`` as in
            the paper: the bias ``slope·(j - i)`` favours later keys otherwise). Both are
            self-attention only (``key``/``value`` None or the query tensor itself).
            Absolute encodings are added to the embeddings before the first layer instead.
        batch_first: True (default): inputs and output are ``(B, L, E)``; False: ``(L, B, E)``
            as torch's ``nn.MultiheadAttention(batch_first=False)`` (its default). Masks and
            weights are ``(B, H, L, S)`` either way.
        device, dtype: where and in which dtype the projections are built, as torch's modules
            (``device="meta"`` builds shapes only). ALiBi's slopes stay float32.

    Masks are attnkit's: **bool True = attend**, float = additive bias. See :meth:`forward`.
    Convert to and from ``torch.nn.MultiheadAttention`` with :meth:`from_torch` / :meth:`to_torch`.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 kdim: int | None = None, vdim: int | None = None, bias: bool = True,
                 dropout: float = 0.0, positional=None, batch_first: bool = True, device=None, dtype=None):
        super().__init__()
        if not isinstance(batch_first, bool):
            raise TypeError(f"batch_first: expected True or False, got {batch_first!r}.")
        embed_dim = _check_pos_int("embed_dim", embed_dim)
        num_heads = _check_pos_int("num_heads", num_heads)
        if embed_dim % num_heads:
            lo = max(num_heads, embed_dim // num_heads * num_heads)
            raise ValueError(
                f"embed_dim: expected a multiple of num_heads={num_heads} (head dim = embed_dim // num_heads), "
                f"got {embed_dim} ({embed_dim} % {num_heads} = {embed_dim % num_heads}). "
                f"Use embed_dim {lo} or {lo + num_heads}, or a num_heads that divides {embed_dim}."
            )
        num_kv_heads = num_heads if num_kv_heads is None else _check_pos_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
            raise ValueError(
                f"num_kv_heads: expected a divisor of num_heads={num_heads} (query head h uses kv head "
                f"h // (num_heads // num_kv_heads)), got {num_kv_heads}. Use one of {divisors}."
            )
        kdim = embed_dim if kdim is None else _check_pos_int("kdim", kdim)
        vdim = embed_dim if vdim is None else _check_pos_int("vdim", vdim)
        if not isinstance(bias, bool):
            raise TypeError(f"bias: expected True or False, got {bias!r}.")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (0.0 <= dropout < 1.0):
            raise ValueError(f"dropout: expected a float in [0, 1), got {dropout!r}.")

        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim, self.vdim, self.bias, self.dropout = kdim, vdim, bias, float(dropout)
        self.batch_first = batch_first
        factory = {"device": device, "dtype": dtype}  # as torch's modules: where and in which dtype to build
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim, num_kv_heads * self.head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim, num_kv_heads * self.head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._reset_parameters()

        self.rotary: RotaryEmbedding | None = None
        #: "rope", "alibi" or None
        self.positional: str | None = None if positional is None else "rope"
        if isinstance(positional, str) and positional == "rope":
            if self.head_dim % 2:
                raise ValueError(
                    f"positional: 'rope' needs an even head dim, got head_dim = embed_dim // num_heads = "
                    f"{embed_dim} // {num_heads} = {self.head_dim}. Choose embed_dim / num_heads so it is even."
                )
            self.rotary = RotaryEmbedding(self.head_dim)
        elif isinstance(positional, RotaryEmbedding):
            if positional.head_dim != self.head_dim:
                raise ValueError(
                    f"positional: RotaryEmbedding(head_dim={positional.head_dim}) does not match this module's "
                    f"head dim {self.head_dim} (= {embed_dim} // {num_heads}). Build it as "
                    f"RotaryEmbedding({self.head_dim})."
                )
            self.rotary = positional
        elif isinstance(positional, str) and positional == "alibi":
            self.positional = "alibi"
            self.register_buffer("alibi_slopes", alibi_slopes(num_heads).to(device), persistent=False)
        elif isinstance(positional, (SinusoidalPositionalEncoding, LearnedPositionalEmbedding)):
            raise TypeError(
                f"positional: {type(positional).__name__} is an absolute encoding added to the token "
                "embeddings (B, L, E) once, before the first layer; it is not applied inside attention. "
                f"Call it on your embeddings and pass positional={_POSITIONAL_HELP} here."
            )
        elif positional is not None:
            raise TypeError(f"positional: expected {_POSITIONAL_HELP}, got {positional!r}.")

    def _reset_parameters(self) -> None:
        # As torch.nn.MultiheadAttention._reset_parameters: Xavier-uniform on the input projections,
        # zero biases, out_proj keeps nn.Linear's default weight init. When q, k, v all read E features
        # torch packs them into one in_proj_weight (3E, E), so its Xavier bound is sqrt(6 / (E + 3E)),
        # not the sqrt(6 / (2E)) of a separate (E, E) matrix: do the same on the packed
        # (E + 2·Hkv·D, E) matrix (= (3E, E) without GQA). With kdim/vdim, torch uses one Xavier per weight.
        q, k, v = self.q_proj.weight, self.k_proj.weight, self.v_proj.weight
        if self.kdim == self.vdim == self.embed_dim:
            packed = torch.empty(q.shape[0] + k.shape[0] + v.shape[0], self.embed_dim, dtype=q.dtype)
            nn.init.xavier_uniform_(packed)  # (E + 2·Hkv·D, E)
            with torch.no_grad():
                for w, part in zip((q, k, v), packed.split([q.shape[0], k.shape[0], v.shape[0]]), strict=True):
                    w.copy_(part)
        else:
            for w in (q, k, v):
                nn.init.xavier_uniform_(w)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    # ------------------------------------------------------------------ public API

    def _apply(self, fn, recurse=True):
        # .half() / .bfloat16() / .to(dtype) cast every float buffer; ALiBi's slopes stay float32 (the docstring's
        # promise: a bf16 slope of H = 16 heads is 7.6e-5 off, and its bias grows with the distance it multiplies)
        out = super()._apply(fn, recurse)
        slopes = self.__dict__["_buffers"].get("alibi_slopes")
        if slopes is not None and slopes.dtype != torch.float32:
            self.alibi_slopes = alibi_slopes(self.num_heads).to(slopes.device)
        return out

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty :class:`~attnkit.nn.KVCache` for this layer: ``(B, Hkv, max_length, D)`` buffers
        in the module's dtype and device — or, built under ``torch.autocast``, in autocast's dtype,
        which is what the layer's projections then give (float64 kept, as autocast keeps it)."""
        w = self.k_proj.weight
        dtype = w.dtype
        if torch.is_autocast_enabled(w.device.type) and dtype != torch.float64:
            dtype = torch.get_autocast_dtype(w.device.type)
        return KVCache(batch_size, self.num_kv_heads, max_length, self.head_dim, dtype=dtype, device=w.device)

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                *, mask=None, causal: bool | None = None, need_weights: bool = False,
                kv_cache: KVCache | None = None, context_parallel=None):
        r"""Attend from ``query (B, L, E)`` to ``key (B, S, kdim)`` / ``value (B, S, vdim)``
        (self-attention when both are None, or both are ``query`` itself as in ``m(x, x, x)``).

        Args:
            mask: anything :func:`attnkit.attention` accepts, broadcastable to ``(B, H, L, S)``:
                a bool tensor (**True = attend**), a float bias, an :mod:`attnkit.masks`
                mask or a ``mask_mod``. Like every attnkit mask, a tensor lines up with
                ``(B, H, L, S)`` **from the right**, so a 2-D mask is always ``(L, S)``
                (the same for every sequence) — never torch's ``(B, S)`` key padding mask,
                even when ``B == L`` happens to make the shapes fit::

                    mask (L, S)          ->  (1, 1, L, S)   one pattern for all sequences
                    keep (B, S)          ->  (1, 1, B, S)   WRONG: rows read as queries
                    keep[:, None, None, :]   (B, 1, 1, S)   right: per-sequence key padding

                A per-sequence key padding mask therefore goes in as

                * ``attnkit.masks.padding(lengths)`` (``lengths (B,)``: keys ``j < lengths[b]``), or
                * a bool ``keep (B, S)`` reshaped to ``keep[:, None, None, :]`` (B, 1, 1, S)::

                    keep = [[T T T T],        lengths = [4, 2]:  masks.padding([4, 2])
                            [T T F F]]        is the same mask as keep[:, None, None, :]

                (torch's ``key_padding_mask`` is True = *ignore*: pass ``~key_padding_mask[:, None, None, :]``.)
            causal: ``True``: causal mask, bottom-right aligned when L ≠ S. ``False``: none.
                ``None`` (default): causal exactly when ``kv_cache`` is given, else not.
                ``causal=False`` with a ``kv_cache`` raises ``ValueError``: decoding with a
                cache is causal by construction (later tokens are not cached yet).
            need_weights: also return the exact per-head weights ``(B, H, L, S)``
                (before dropout), recomputed from the log-sum-exp of whichever backend
                ran (``attention(..., return_weights=True)``).
            kv_cache: a :class:`~attnkit.nn.KVCache` from :meth:`new_cache` (self-attention
                only; one cache per layer, and decode under ``torch.no_grad()`` — see
                :class:`~attnkit.nn.KVCache`). The new keys/values are appended and the
                query attends **causally** (bottom-right) over everything cached; RoPE
                positions start at the cached length. ``S`` is then the cached length
                including the new tokens::

                    cache holds 3, query L = 2:   k0 k1 k2 n0 n1
                                              n0   #  #  #  #  .
                                              n1   #  #  #  #  #

                The cache has one length for the whole batch, so every row's tokens sit at the
                same positions: **pad a batch of prompts on the left** (with a padding mask of
                the pad keys), as generation does. Right padding puts a short prompt's next
                tokens after its pads — with RoPE at positions the unpadded sequence would not
                have (a different answer, not an error).

            context_parallel: an :class:`attnkit.distributed.ContextParallel` (one sequence split
                across processes): ``query`` is this rank's rows ``(B, L_r, E)`` (``cp.shard(x, dim=1)``),
                self-attention only; RoPE and ALiBi use the layout's global positions, the mask is the
                one ``cp`` was built with (plus ``causal``). No ``kv_cache``, ``need_weights`` or dropout.

        Returns:
            ``output (B, L, E)``, or ``(output, weights (B, H, L, S))`` with ``need_weights=True``.
        """
        if type(query) is not torch.Tensor and isinstance(query, torch.fx.Proxy):
            raise TypeError(
                f"query: torch.fx.symbolic_trace cannot trace {type(self).__name__}.forward (it checks its inputs' "
                "shapes and picks a path by its arguments). Keep the module a leaf (a torch.fx.Tracer whose "
                "is_leaf_module answers True for it), or trace with torch.export.export / torch.jit.trace, which "
                "record attnkit's op; attnkit.attention itself traces under torch.fx as one node.")
        if context_parallel is not None:
            return self._context_parallel(query, key, value, context_parallel, mask=mask, causal=causal,
                                          need_weights=need_weights, kv_cache=kv_cache)
        if key is None and value is not None:
            raise TypeError("key: got value but no key. Pass key= as well (value defaults to key, not the reverse).")
        if not self.batch_first:  # (L, B, E) in and out, as torch's default layout
            def tr(x):
                return x.transpose(0, 1) if isinstance(x, torch.Tensor) and x.dim() == 3 else x

            same_k, same_v = key is query, value is query or (value is key and key is not None)
            tq = tr(query)
            tk = tq if same_k else tr(key)
            tv = (tq if value is query else tk) if same_v else tr(value)
            self.batch_first = True
            self.__dict__["_seq_first_call"] = True  # (messages about the inputs describe the caller's layout)
            try:
                res = self.forward(tq, tk, tv, mask=mask, causal=causal, need_weights=need_weights, kv_cache=kv_cache)
            finally:
                self.batch_first = False
                self.__dict__["_seq_first_call"] = False
            return (res[0].transpose(0, 1), res[1]) if need_weights else res.transpose(0, 1)
        # torch's calling style m(x, x, x) (or m(x, x)) is self-attention too
        self_attn = key is None or (key is query and (value is None or value is query))
        if value is None:
            value = key
        ref = self.q_proj.weight
        B, L = self._check_input("query", query, self.embed_dim, ref, self.__dict__.get("_seq_first_call", False))
        if not self_attn:
            if kv_cache is not None:
                raise TypeError(
                    "kv_cache: only for self-attention (key/value None). For cross-attention over a fixed "
                    "memory, project it once and call without a cache."
                )
            if self.positional is not None:
                raise ValueError(
                    f"positional={self.positional!r}: relative positions between two different sequences are "
                    "undefined, so RoPE/ALiBi are self-attention only. Use a separate module with "
                    "positional=None for cross-attention (for self-attention pass key=value=None, or the "
                    "query tensor itself)."
                )
            seq_first = self.__dict__.get("_seq_first_call", False)
            Bk, S = self._check_input("key", key, self.kdim, ref, seq_first)
            Bv, Sv = self._check_input("value", value, self.vdim, ref, seq_first)
            if Bk != B or Bv != B:
                raise ValueError(
                    f"key/value: expected batch size {B} (that of query), got key {Bk}, value {Bv}. "
                    "query, key and value must hold the same sequences; attnkit does not broadcast the batch."
                )
            if Sv != S:
                raise ValueError(f"value: expected S={S} positions (that of key), got {Sv}.")
        else:
            if (self.kdim, self.vdim) != (self.embed_dim, self.embed_dim):
                raise ValueError(
                    f"key/value: this module projects keys from kdim={self.kdim} and values from vdim={self.vdim} "
                    f"features, so it cannot attend to the query (embed_dim={self.embed_dim}) itself. Pass key "
                    "and value tensors (cross-attention)."
                )
            key = value = query
            S = L
        if not isinstance(need_weights, bool):
            raise TypeError(f"need_weights: expected True or False, got {need_weights!r}.")
        if causal is not None and not isinstance(causal, bool):
            raise TypeError(f"causal: expected True, False or None (causal when a kv_cache is used), got {causal!r}.")
        if kv_cache is not None:
            if not isinstance(kv_cache, KVCache):
                raise TypeError("kv_cache: expected an attnkit.nn.KVCache (from new_cache), got "
                                f"{type(kv_cache).__name__}.")
            if causal is False:
                raise ValueError(
                    "causal=False with a kv_cache: decoding with a cache is causal by construction (the tokens "
                    "after the current one are not cached yet). Leave causal=None (the default) or True, or "
                    "attend without a cache for non-causal attention."
                )
            kv_cache.check_batch(B)
            kv_cache.check_owner(self)
        causal = kv_cache is not None if causal is None else causal

        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(query).reshape(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        k = self.k_proj(key).reshape(B, S, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
        v = self.v_proj(value).reshape(B, S, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)

        prev = 0 if kv_cache is None else kv_cache.length
        if self.rotary is not None:  # positions prev .. prev + L - 1, before caching k
            q = self.rotary.rotate(q, prev)
            k = self.rotary.rotate(k, prev)
        if kv_cache is not None:
            prev_owner = kv_cache._owner
            k, v = kv_cache.append(k, v, owner=self)  # (B, Hkv, prev + L, D); raises before writing
        score_mod = None
        if self.positional == "alibi":
            # kv_idx - q_idx is off by the constant S - L per row when L != S; softmax is shift-invariant.
            score_mod = _score_mods.alibi(self.alibi_slopes)
        p = self.dropout if self.training else 0.0
        try:
            if need_weights:  # exact weights recomputed from lse by the front door (before dropout)
                out, weights = attention(q, k, v, mask=mask, causal=causal, score_mod=score_mod, dropout_p=p,
                                         return_weights=True)
            else:
                out = attention(q, k, v, mask=mask, causal=causal, score_mod=score_mod, dropout_p=p)
        except Exception:
            if kv_cache is not None:  # a failed call leaves the cache as it was
                kv_cache.length, kv_cache._owner = prev, prev_owner
            raise
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.embed_dim))  # (B, L, E)
        return (out, weights) if need_weights else out

    def _context_parallel(self, x, key, value, cp, *, mask, causal, need_weights, kv_cache):
        """Self-attention over a sequence sharded by ``cp`` (duck-typed: ``positions``,
        ``attention``), so ``attnkit.nn`` never imports ``attnkit.distributed``."""
        if not (key is None or key is x) or not (value is None or value is x):
            raise ValueError("context_parallel: self-attention only (key/value None or the query itself).")
        for name, bad in (("kv_cache", kv_cache is not None), ("need_weights", need_weights),
                          ("mask", mask is not None)):
            if bad:
                raise ValueError(f"context_parallel: {name} is not supported with a context-parallel call "
                                 "(the mask is fixed when the ContextParallel is built).")
        if self.training and self.dropout:
            raise ValueError("context_parallel: attention dropout is not supported; use dropout=0 or eval mode.")
        if hasattr(cp, "check_module"):
            cp.check_module(self)  # the same weights on every rank, checked at the first call
        if not self.batch_first:
            x = x.transpose(0, 1)
        B, n = self._check_input("query", x, self.embed_dim, self.q_proj.weight)
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).reshape(B, n, H, D).transpose(1, 2)  # (B, H, L_r, D)
        k = self.k_proj(x).reshape(B, n, Hkv, D).transpose(1, 2)  # (B, Hkv, L_r, D)
        v = self.v_proj(x).reshape(B, n, Hkv, D).transpose(1, 2)
        if self.rotary is not None:  # rows sit at the layout's global positions
            q = self.rotary.rotate(q, positions=cp.positions)
            k = self.rotary.rotate(k, positions=cp.positions)
        score_mod = _score_mods.alibi(self.alibi_slopes) if self.positional == "alibi" else None
        out = cp.attention(q, k, v, causal=bool(causal), score_mod=score_mod)
        out = self.out_proj(out.transpose(1, 2).reshape(B, n, self.embed_dim))  # (B, L_r, E)
        return out if self.batch_first else out.transpose(0, 1)

    @staticmethod
    def _check_input(name: str, x, features: int, ref: torch.Tensor, seq_first: bool = False):
        """``seq_first``: the caller's module is ``batch_first=False`` (``x`` arrives here transposed to batch first;
        a message shows the caller's own shape and layout)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor (B, L, {features}), got {type(x).__name__}.")
        if x.dim() != 3 or x.shape[-1] != features:
            what = {"query": "embed_dim", "key": "kdim", "value": "vdim"}[name]
            n = "L" if name == "query" else "S"
            shape = tuple(x.transpose(0, 1).shape) if seq_first and x.dim() == 3 else tuple(x.shape)
            hint = (f"add a batch dim with x.unsqueeze({1 if seq_first else 0})" if x.dim() == 2
                    else f"project it to {what}={features}")
            layout = f"({n}, B, {what}={features}) (batch_first=False)" if seq_first else \
                f"(B, {n}, {what}={features}) (batch first)"
            raise ValueError(f"{name}: expected shape {layout}, got {shape}. Fix: {hint}.")
        if x.dtype != ref.dtype or x.device != ref.device:
            raise TypeError(
                f"{name}: expected {ref.dtype} on {ref.device} (the module's parameters), got {x.dtype} on "
                f"{x.device}. Convert the input or the module (module.to(...)); nothing is cast silently."
            )
        return x.shape[0], x.shape[1]

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """A ``MultiHeadAttention`` with the weights of a ``torch.nn.MultiheadAttention``
        (packed or separate q/k/v weights, bias on or off; see :func:`attnkit.nn.from_torch`).

        **Masks keep attnkit's polarity, True = attend**; torch's ``key_padding_mask`` is
        True = ignore, so pass ``mask=~key_padding_mask[:, None, None, :]`` (and ``~attn_mask``
        for a bool ``attn_mask``). The converted module also takes torch's ``key_padding_mask=``
        and ``is_causal=``, and a torch-style call (``query, key, value`` positionally, none of
        attnkit's keywords) answers with torch's ``(out, weights)`` tuple, so ``out, _ = m(x, x, x)``
        keeps its meaning::

            out, w = m(x, x, x)       # torch's style: w averaged over heads (B, L, S)
            out = m(x, mask=keep)     # attnkit's style: the output alone
        """
        return _torch_convert.from_torch(module, cls)

    def to_torch(self, *, batch_first: bool | None = None) -> nn.MultiheadAttention:
        """An equivalent ``torch.nn.MultiheadAttention`` (see :func:`attnkit.nn.to_torch`);
        ``batch_first`` defaults to this module's.

        **Masks keep their polarity on each side**: an attnkit bool mask (True = attend)
        becomes torch's ``key_padding_mask=~keep`` / ``attn_mask=~mask`` (True = ignore).
        """
        return _torch_convert.to_torch(self, batch_first=self.batch_first if batch_first is None else batch_first)

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}"
        if (self.kdim, self.vdim) != (self.embed_dim, self.embed_dim):
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.positional is not None:
            s += f", positional={self.positional!r}"
        if not self.batch_first:
            s += ", batch_first=False"
        return s
