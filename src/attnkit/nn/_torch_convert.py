"""Weight conversion between ``attnkit.nn.MultiHeadAttention`` and ``torch.nn.MultiheadAttention``.

Parameter correspondence (E embed dim)::

    torch                                   attnkit
    in_proj_weight (3E, E)  = [Wq; Wk; Wv]  q_proj.weight, k_proj.weight, v_proj.weight   (kdim = vdim = E)
    q/k/v_proj_weight (E, E|kdim|vdim)      q_proj.weight, k_proj.weight, v_proj.weight   (kdim or vdim != E)
    in_proj_bias (3E,)      = [bq; bk; bv]  q_proj.bias,   k_proj.bias,   v_proj.bias
    out_proj.weight / .bias                 out_proj.weight / .bias

**Mask polarity differs.** attnkit bool masks are True = *attend*; torch's
``key_padding_mask`` and bool ``attn_mask`` are True = *ignore*. The weights convert;
masks do not — invert them when you switch::

    torch_mha(x, x, x, key_padding_mask=pad)          # pad (B, S): True = padding
    attnkit_mha(x, mask=~pad[:, None, None, :])       # (B, 1, 1, S): True = attend
    torch_mha(x, x, x, attn_mask=block)               # block (L, S): True = not allowed
    attnkit_mha(x, mask=~block)

A module made by ``from_torch`` also takes torch's own keyword, ``key_padding_mask=pad`` with
torch's polarity (bool ``(B, S)``, True = padding; or a float ``(B, S)`` added to the scores), so
code written for the torch module keeps working; it becomes ``mask=~pad[:, None, None, :]``
(or the float bias ``pad[:, None, None, :]``).

Called as torch's module is called — ``query, key, value`` (by position or by name; torch's
``key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal`` may follow by position too),
with none of attnkit's own keywords (``mask``, ``causal``, ``kv_cache``, ``context_parallel``) — it also
answers as torch's does: the tuple ``(out, weights)``, ``weights`` averaged over the heads ``(B, L, S)``
unless ``average_attn_weights=False`` (then ``(B, H, L, S)``), or ``(out, None)`` with ``need_weights=False``
(torch's default is True, and so is this one's here); ``is_causal=`` is torch's ``causal=``. So ``out, _ =
m(x, x, x)`` is torch's output, never batch row 0 unpacked from a bare tensor. (In training mode with dropout its
weights are those before dropout, as attnkit's ``need_weights`` gives them; torch's are after.) Parameters keep
torch's ``requires_grad`` both ways. Called in attnkit's style
(``m(x)``, ``m(x, mask=...)``) it answers as
:class:`~attnkit.nn.MultiHeadAttention` does::

    out, w = m(x, x, x)                   # torch's style: (out, weights averaged over heads)
    out, _ = m(x, x, x, need_weights=False)
    out = m(x, mask=keep)                 # attnkit's style: out alone
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["from_torch", "to_torch"]


def from_torch(module: nn.MultiheadAttention, cls):
    """``cls`` is :class:`~attnkit.nn.MultiHeadAttention` (passed in, so this module does not
    import it: the module's classmethod calls here — no import cycle)."""
    return _from_torch(module, cls)


def _from_torch(module: nn.MultiheadAttention, MultiHeadAttention):
    """A :class:`MultiHeadAttention` with the weights of ``module``, same dtype and device.

    Handles the packed ``in_proj_weight`` (kdim = vdim = E) and the separate
    ``q/k/v_proj_weight`` (kdim or vdim ≠ E), with or without bias. The result takes
    its inputs in the module's layout: ``batch_first=False`` (torch's default) means
    ``(L, B, E)`` in and out, exactly as the module it replaces.

    **Masks keep attnkit's polarity (True = attend)**: torch's ``key_padding_mask``
    (True = ignore) becomes ``mask=~key_padding_mask[:, None, None, :]``.

    Raises ``ValueError`` for ``add_bias_kv=True`` / ``add_zero_attn=True`` (no attnkit equivalent).
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"module: expected a torch.nn.MultiheadAttention, got {type(module).__name__}.")
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError(
            "module: add_bias_kv=True / add_zero_attn=True append extra key positions that attnkit's "
            "MultiHeadAttention does not model. Convert a module built without them."
        )
    ref = module.out_proj.weight
    bias = module.in_proj_bias is not None
    mha = MultiHeadAttention(module.embed_dim, module.num_heads, kdim=module.kdim, vdim=module.vdim,
                             bias=bias, dropout=float(module.dropout),
                             batch_first=bool(module.batch_first)).to(device=ref.device, dtype=ref.dtype)
    if module._qkv_same_embed_dim:
        wq, wk, wv = module.in_proj_weight.chunk(3, dim=0)
    else:
        wq, wk, wv = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
    with torch.no_grad():
        for lin, w in ((mha.q_proj, wq), (mha.k_proj, wk), (mha.v_proj, wv), (mha.out_proj, module.out_proj.weight)):
            lin.weight.copy_(w)
        if bias:
            bq, bk, bv = module.in_proj_bias.chunk(3, dim=0)
            for lin, b in ((mha.q_proj, bq), (mha.k_proj, bk), (mha.v_proj, bv), (mha.out_proj, module.out_proj.bias)):
                lin.bias.copy_(b)
    # frozen stays frozen (requires_grad as on torch's side; a packed in_proj_* is one flag for q, k and v)
    packed = module._qkv_same_embed_dim
    flags_w = ([module.in_proj_weight.requires_grad] * 3 if packed else
               [t.requires_grad for t in (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)])
    for lin, flag in zip((mha.q_proj, mha.k_proj, mha.v_proj), flags_w, strict=True):
        lin.weight.requires_grad_(flag)
        if bias:
            lin.bias.requires_grad_(module.in_proj_bias.requires_grad)
    mha.out_proj.weight.requires_grad_(module.out_proj.weight.requires_grad)
    if bias:
        mha.out_proj.bias.requires_grad_(module.out_proj.bias.requires_grad)
    mha.train(module.training)
    mha.register_forward_pre_hook(_torch_call, with_kwargs=True)
    mha.register_forward_hook(_torch_result, with_kwargs=True)
    return mha


_ATTNKIT_ONLY = frozenset(("mask", "causal", "kv_cache", "context_parallel"))  # keywords torch's module has not
# torch's MultiheadAttention.forward, in order: what a torch-style call passes positionally after query, key, value
_TORCH_POSITIONAL = ("key_padding_mask", "need_weights", "attn_mask", "average_attn_weights", "is_causal")


def _torch_call(module, args, kwargs):
    """Forward pre-hook of a ``from_torch`` module: torch's keywords in attnkit's terms, and whether this call is
    torch's style (``query, key, value`` all given, by position or by name, as torch's module requires them: it
    answers with torch's tuple, :func:`_torch_result`)."""
    if len(args) > 3:  # torch's positional signature past value
        extra = args[3:]
        if len(extra) > len(_TORCH_POSITIONAL):
            raise TypeError(f"forward: torch's MultiheadAttention takes at most {3 + len(_TORCH_POSITIONAL)} "
                            f"positional arguments (query, key, value, {', '.join(_TORCH_POSITIONAL)}), got "
                            f"{len(args)}.")
        for name, val in zip(_TORCH_POSITIONAL, extra, strict=False):
            if name in kwargs:
                raise TypeError(f"forward: got {name} both by position and by name.")
            kwargs[name] = val
        args = args[:3]
    named = ("query", "key", "value")[len(args):]
    torch_style = all(n in kwargs for n in named) and not _ATTNKIT_ONLY & kwargs.keys()
    if kwargs.get("attn_mask", 0) is None:  # torch's explicit "no mask"
        del kwargs["attn_mask"]
    want = None
    if torch_style:
        need = kwargs.pop("need_weights", True)
        average = kwargs.pop("average_attn_weights", True)
        if not isinstance(need, bool) or not isinstance(average, bool):
            raise TypeError(f"need_weights / average_attn_weights: expected True or False, got {need!r} / "
                            f"{average!r}.")
        kwargs["need_weights"] = need
        want = (need, average)
    if "is_causal" in kwargs:
        if kwargs.get("causal") is not None:
            raise ValueError("is_causal: pass either torch's is_causal= or attnkit's causal=, not both.")
        kwargs["causal"] = kwargs.pop("is_causal")
    if "attn_mask" in kwargs:
        raise TypeError("attn_mask: torch's attn_mask (True = not allowed) is attnkit's mask= with the other "
                        "polarity: pass mask=~attn_mask for a bool (L, S) mask, mask=attn_mask for a float one, "
                        "a (B * H, L, S) one reshaped to (B, H, L, S).")
    module.__dict__["_torch_style"] = want  # (set on every call: a call that raised leaves nothing behind)
    _torch_key_padding_mask(module, args, kwargs)
    return args, kwargs


def _torch_result(module, args, kwargs, output):
    """Forward hook of a ``from_torch`` module: a torch-style call's answer as torch's ``(out, weights)``."""
    want = module.__dict__.pop("_torch_style", None)
    if want is None:
        return None
    need, average = want
    if not need:
        return output, None
    out, weights = output
    return out, (weights.mean(dim=1) if average else weights)


def _torch_key_padding_mask(module, args, kwargs) -> None:
    """Part of the pre-hook (:func:`_torch_call`), in place on ``kwargs``: torch's ``key_padding_mask=`` (True = ignore)
    becomes attnkit's ``mask=`` (True = attend), ``(B, S)`` → ``(B, 1, 1, S)``::

        key_padding_mask  [[F F F T],      mask  [[T T T F],      (B, 1, 1, S): per sequence,
                           [F F T T]]  →          [T T F F]]      the same for every head and query
    """
    if "key_padding_mask" not in kwargs:
        return
    pad = kwargs.pop("key_padding_mask")
    if pad is None:
        return
    if kwargs.get("mask") is not None:
        raise ValueError("key_padding_mask: pass either torch's key_padding_mask= (True = ignore) or attnkit's "
                         "mask= (True = attend), not both. Fold the padding into the mask: "
                         "mask & ~key_padding_mask[:, None, None, :].")
    if not isinstance(pad, torch.Tensor) or pad.dim() != 2:
        got = f"shape {tuple(pad.shape)}" if isinstance(pad, torch.Tensor) else type(pad).__name__
        raise ValueError(f"key_padding_mask: expected torch's (B, S) tensor (bool True = padding, or float added "
                         f"to the scores), got {got}. For other masks use mask= (True = attend).")
    if pad.dtype == torch.bool:
        kwargs["mask"] = ~pad[:, None, None, :]
    elif pad.is_floating_point():
        kwargs["mask"] = pad[:, None, None, :]
    else:
        raise ValueError(f"key_padding_mask: expected a bool (True = padding) or float tensor, got {pad.dtype}. "
                         "Pass key_padding_mask.bool() for 0/1 padding flags.")


def to_torch(mha, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """An equivalent ``torch.nn.MultiheadAttention`` (same weights, dtype, device and train/eval mode).

    Only plain multi-head attention converts: ``num_kv_heads == num_heads`` and no
    ``positional`` (torch's module has neither GQA nor RoPE/ALiBi).

    **Masks keep their polarity on each side**: attnkit's True = attend becomes torch's
    ``attn_mask=~mask`` / ``key_padding_mask=~keep`` (True = ignore).
    """
    if not hasattr(mha, "num_kv_heads") or not isinstance(mha, torch.nn.Module):
        raise TypeError(f"mha: expected an attnkit.nn.MultiHeadAttention, got {type(mha).__name__}.")
    if mha.num_kv_heads != mha.num_heads:
        raise ValueError(
            f"mha: torch.nn.MultiheadAttention has no grouped-query heads, got num_kv_heads={mha.num_kv_heads} "
            f"!= num_heads={mha.num_heads}. Only num_kv_heads=None (= num_heads) converts."
        )
    if mha.positional is not None:
        raise ValueError(
            f"mha: torch.nn.MultiheadAttention has no positional={mha.positional!r}. Only positional=None converts."
        )
    ref = mha.out_proj.weight
    qkv = (mha.q_proj, mha.k_proj, mha.v_proj)
    same = mha.kdim == mha.vdim == mha.embed_dim  # torch packs q, k, v into in_proj_weight: one requires_grad
    for part in ("weight", "bias") if same else ("bias",):
        flags = {getattr(lin, part).requires_grad for lin in qkv if getattr(lin, part) is not None}
        if len(flags) > 1:
            raise ValueError(f"mha: the q / k / v projections' {part}s differ in requires_grad (some frozen), and "
                             f"torch.nn.MultiheadAttention holds them in one in_proj_{part}. Freeze all three or none.")
    tm = nn.MultiheadAttention(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.bias,
                               kdim=mha.kdim, vdim=mha.vdim, batch_first=batch_first,
                               device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        if tm._qkv_same_embed_dim:
            tm.in_proj_weight.copy_(torch.cat([mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight], 0))
        else:
            tm.q_proj_weight.copy_(mha.q_proj.weight)
            tm.k_proj_weight.copy_(mha.k_proj.weight)
            tm.v_proj_weight.copy_(mha.v_proj.weight)
        tm.out_proj.weight.copy_(mha.out_proj.weight)
        if mha.bias:
            tm.in_proj_bias.copy_(torch.cat([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias], 0))
            tm.out_proj.bias.copy_(mha.out_proj.bias)
    if tm._qkv_same_embed_dim:
        tm.in_proj_weight.requires_grad_(mha.q_proj.weight.requires_grad)
    else:
        for t, lin in zip((tm.q_proj_weight, tm.k_proj_weight, tm.v_proj_weight), qkv, strict=True):
            t.requires_grad_(lin.weight.requires_grad)
    tm.out_proj.weight.requires_grad_(mha.out_proj.weight.requires_grad)
    if mha.bias:
        tm.in_proj_bias.requires_grad_(mha.q_proj.bias.requires_grad)
        tm.out_proj.bias.requires_grad_(mha.out_proj.bias.requires_grad)
    tm.train(mha.training)
    return tm
