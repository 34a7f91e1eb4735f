"""The attention forward: transformers' attention hook for ``"attnkit"``.

Shape legend: B batch, H query heads, Hkv key/value heads, L query length,
S key length, D head dim, Dv value head dim.

Every keyword argument is handled, harmless or refused (:mod:`._refusals`); the mask comes
translated (:mod:`._mask_translation`); softcap, T5's position bias and sinks are folded into one
``attnkit.attention`` call; weights are returned when the model asks for attentions, and recorded
under a capture (:mod:`._capture`).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import masks as _masks
from ... import score_mods as _score_mods
from ...api import attention
from ._capture import ACTIVE
from ._mask_translation import resolve_mask
from ._refusals import alternatives, check_kwargs, describe

__all__ = ["attnkit_attention_forward"]


# transformers' context variable of the output recorder, looked up once (False: this transformers has none);
# Any: its class (CompileableContextVar today) is transformers' own and changes between versions
_COLLECTOR: Any = None


def _recorder_wants_attentions() -> bool:
    """Whether transformers' output recorder (``capture_outputs``) is collecting attention weights now.

    Models such as GPT-2 consume ``output_attentions`` before their layers and record
    the second output of each attention module through forward hooks instead.
    """
    global _COLLECTOR
    if _COLLECTOR is None:
        try:
            from transformers.utils.output_capturing import _active_collector as _COLLECTOR
        except ImportError:  # pragma: no cover - older transformers pass output_attentions down
            _COLLECTOR = False
    if _COLLECTOR is False:  # pragma: no cover
        return False
    collected = _COLLECTOR.get()
    return bool(collected) and any(k != "hidden_states" and k.endswith("attentions") for k in collected)


def _check_sliding_window(module, sliding_window, attention_mask, key):
    """transformers puts a sliding window into ``attention_mask``; refuse the one case where it is not there."""
    S = key.shape[2]
    if sliding_window is not None and attention_mask is None and isinstance(sliding_window, int) and S > sliding_window:
        raise ValueError(
            f"sliding_window: expected the window to be in attention_mask (transformers builds it there), got "
            f"sliding_window={sliding_window} with no attention_mask and {S} keys from {type(module).__name__}; "
            f"attnkit would attend to all {S} keys. Load this model with {alternatives(module)}.")


def _check_packed(module, kwargs, mask, query, key):
    """cu_seq_lens_q/k (packed sequences): check the mask already keeps the sequences apart."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    B, _, L, _ = query.shape
    S = key.shape[2]
    fix = ("transformers keeps packed sequences apart only through the mask, which it builds from position_ids "
           "when there is no attention_mask and no cache: pass position_ids and use_cache=False (eager and sdpa "
           "ignore cu_seq_lens_q/k just the same).")
    if B != 1 or int(cu_q[-1]) != L or int(cu_k[-1]) != S:
        raise ValueError(f"cu_seq_lens_q/k: expected one packed row (B=1) ending at L={L} and S={S}, got B={B}, "
                         f"cu_seq_lens_q[-1]={int(cu_q[-1])}, cu_seq_lens_k[-1]={int(cu_k[-1])}. {fix}")
    doc_q = torch.searchsorted(cu_q[1:].to(query.device), torch.arange(L, device=query.device), right=True)
    doc_k = torch.searchsorted(cu_k[1:].to(query.device), torch.arange(S, device=query.device), right=True)
    across = doc_q[:, None] != doc_k[None, :]  # (L, S)
    if isinstance(mask, _masks.Mask):
        allowed = mask.materialize(1, 1, L, S, device=query.device)
    elif isinstance(mask, torch.Tensor):
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    else:
        allowed = torch.ones(1, 1, L, S, dtype=torch.bool, device=query.device)
    if (allowed & across).any():
        raise ValueError(f"cu_seq_lens_q/k: expected the attention mask to keep the {len(cu_k) - 1} packed "
                         "sequences apart, got a mask that lets them attend to each other. " + fix)


def _with_position_bias(position_bias, mask, causal, query, key):
    """Fold T5-style ``position_bias`` ``(1|B, H, L, S)`` and the mask into one additive float mask.

    Differentiable in ``position_bias`` (the relative-bias table learns through it).
    Masked positions get -inf (a fully masked row: output 0, lse -inf).
    """
    B, _, L, _ = query.shape
    S = key.shape[2]
    pb = position_bias
    if pb.dtype != query.dtype and not (pb.dtype == torch.float32 and query.dtype in (torch.float16, torch.bfloat16)):
        pb = pb.to(query.dtype)  # eager adds it to scores in q's dtype
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        return pb + mask.to(pb.dtype), causal
    if isinstance(mask, _masks.Mask):
        mask = mask.materialize(B, 1, L, S, device=query.device)
    if mask is None:
        return pb, causal
    return torch.where(mask, pb, torch.full((), float("-inf"), dtype=pb.dtype, device=pb.device)), causal


def _sink_logits(module, s_aux, sinks, query):
    """Sink logits broadcastable to ``(B, H, L)`` from ``s_aux`` ``(H,)`` or ``sinks`` ``(B, H, L, 1)``; or None."""
    B, H, L, _ = query.shape
    if s_aux is not None and sinks is not None:
        raise ValueError(f"s_aux, sinks: expected at most one of them, got both from {type(module).__name__}.")
    if s_aux is not None:
        if not isinstance(s_aux, torch.Tensor) or s_aux.shape != (H,):
            raise ValueError(f"s_aux: expected one sink logit per query head, shape ({H},), got {describe(s_aux)}.")
        return s_aux.view(1, H, 1)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (B, H, L, 1):
            raise ValueError(f"sinks: expected one sink logit per query, shape ({B}, {H}, {L}, 1), "
                             f"got {describe(sinks)}.")
        return sinks.squeeze(-1)
    return None


def attnkit_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                              is_causal=None, sliding_window=None, softcap=None, position_bias=None, s_aux=None,
                              sinks=None, **kwargs):
    """transformers' attention hook for ``"attnkit"``.

    query ``(B, H, L, D)``, key/value ``(B, Hkv, S, D)`` (GQA is native: K/V are
    not repeated). Returns ``(out (B, L, H, Dv), weights (B, H, L, S) or None)``;
    weights are returned when the model asks for attentions (``output_attentions``
    passed down, or transformers' output recorder collecting them), recomputed
    exactly from lse, not kept from the forward.

    What the model passes is honoured, never dropped:

    * ``softcap`` (Gemma 2): ``attnkit.score_mods.softcap(cap)`` on the scaled scores.
    * ``position_bias`` ``(1|B, H, L, S)`` (T5): added to the scaled scores together
      with the mask; gradients reach the relative-bias table.
    * ``s_aux`` ``(H,)`` (GPT-OSS) / ``sinks`` ``(B, H, L, 1)``: a sink logit in each
      softmax denominator, ``lse' = logaddexp(lse, sink)``, ``out' = out·exp(lse − lse')``.
    * ``sliding_window``: already in ``attention_mask`` (checked when there is none).
    * ``cu_seq_lens_q/k``: checked to be kept apart by the mask.
    * ``indices`` / ``block_indices`` (sparse attention), a paged ``cache``, and any
      keyword argument attnkit does not know: ValueError naming it.
    """
    check_kwargs(module, kwargs)
    _check_sliding_window(module, sliding_window, attention_mask, key)
    mask, causal = resolve_mask(module, query, key, attention_mask, is_causal)
    _check_packed(module, kwargs, mask, query, key)
    score_mod = None if softcap is None else _score_mods.softcap(softcap)
    if position_bias is not None:
        mask, causal = _with_position_bias(position_bias, mask, causal, query, key)
    sink = _sink_logits(module, s_aux, sinks, query)
    cap = ACTIVE.get()
    layer, record, heads = None, False, None
    if cap is not None:
        layer = cap.layer_of(module)
        record = cap.layers is None or layer in cap.layers
        heads = cap.heads
        if record:
            cap.check_heads(query.shape[1])
    want_all = bool(kwargs.get("output_attentions", False)) or _recorder_wants_attentions()
    dropout_p = float(dropout) if module.training else 0.0
    if dropout_p > 0 and want_all:
        raise ValueError(
            f"output_attentions=True with attention dropout active (p={dropout_p}, the model is in train mode): "
            "attnkit returns exact weights without dropout, which would not be the ones this forward used. "
            "Call model.eval() first, or run without output_attentions.")
    if dropout_p > 0 and record:
        raise ValueError(f"capturing attention weights of layer {layer} with attention dropout active "
                         f"(p={dropout_p}, the model is in train mode) is not exact; call model.eval() first.")
    # One validated call: exact weights (recomputed from lse, only the heads wanted) and
    # sinks are options of the front door, whichever backend runs.
    which = True if (want_all or heads is None) else heads
    res = attention(query, key, value, mask=mask, causal=causal, scale=scaling, score_mod=score_mod,
                    dropout_p=dropout_p, sinks=sink, return_weights=which if (want_all or record) else False)
    out, w = res if (want_all or record) else (res, None)
    weights = None
    if record:
        assert cap is not None and w is not None, "record is set only under a capture, which asks for weights"
        cap.weights[layer] = (w[:, heads] if (want_all and heads is not None) else w).detach()  # (B, H', L, S)
    if want_all:
        weights = w  # (B, H, L, S), as transformers' eager path returns them
    return out.transpose(1, 2).contiguous(), weights  # (B, L, H, Dv)
