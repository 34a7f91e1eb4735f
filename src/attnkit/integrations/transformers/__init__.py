"""Hugging Face ``transformers`` running on attnkit, and exact weights from its fast path.

Shape legend: B batch, H query heads, Hkv key/value heads, L query length,
S key length, D head dim, Dv value head dim.

    >>> from attnkit.integrations import minilm, transformers as ak_hf   # importing registers "attnkit"
    >>> ak_hf.register()                                   # idempotent: the name to load with
    'attnkit'
    >>> tok, model = minilm.load()     # = AutoModel.from_pretrained(path, attn_implementation="attnkit")
    >>> weights = ak_hf.capture_attention(model, tok(["The river bank."], return_tensors="pt"),
    ...                                   layers=[2], heads=[0, 5])
    >>> tuple(weights[2].shape)                            # (B, 2 heads, L, S)
    (1, 2, 6, 6)

How the pieces fit::

    model.forward ──► mask interface "attnkit" ──► the mask transformers asks for, read off its
                        mask function and 2-D padding mask (structured_mask):
                          causal / sliding window / chunked / bidirectional / packed documents,
                          & padding(lengths) (right) or key_padding(valid) (left, holes)
                        → an attnkit.masks object: no dense (B, 1, L, S) tensor per step
                        (anything else, or a model that slices the mask: transformers' dense mask)
                 ──► every attention layer: attnkit_attention_forward(module, q, k, v, mask, **kw)
                        kw checked first: handled / harmless / refused — an unknown or
                        refused one (indices, block_indices, paged cache) raises, naming it
                        softcap=c          → score_mod=attnkit.score_mods.softcap(c)
                        position_bias (T5) → mask = bias + (mask ? 0 : −inf)   (differentiable)
                        attnkit.attention(q, k, v, mask=…, score_mod=…, sinks=…, return_weights=…)  (auto)
                        s_aux / sinks      → lse' = logaddexp(lse, sink), out·exp(lse − lse')
                        weights wanted? (output_attentions passed down, transformers' output
                        recorder collecting attentions, or a capture of this layer)
                          → exp(q kᵀ·scale [+mods] − lse') for the asked heads only
                            (no L×S tensor for the others, no switch to eager)

Registering only the attention function is not enough: transformers builds no
padding mask for an implementation missing from ``AttentionMaskInterface``, so a
padded batch would silently attend to its padding. ``register()`` adds both, and
importing this module calls it (when transformers is installed), so a forgotten
``register()`` cannot leave transformers without the name: its own error for an
unknown name (``Specified `attn_implementation="attnkit"` is not supported``)
never mentions attnkit.

Models attnkit cannot run (they refuse, never half-run)::

    a model whose attention layers compute attention themselves, without calling transformers'
    attention interface, would get only attnkit's mask: UnsupportedModelError naming the model
    and attn_implementation="eager" (or "sdpa" where the model supports it)
      at construction  Falcon, GPT-J, GPT-Neo, Bark, GIT, SAM, ... (the models that pick their
                       attention class from a *_ATTENTION_CLASSES dict: register() adds an
                       "attnkit" entry that raises, instead of transformers' KeyError: 'attnkit')
      at the first     Bloom, MPT, CodeGen, XGLM, MPNet (all-mpnet-base-v2), RoFormer, BigBird,
      forward          Longformer, LED, ... (their modeling module defines an attention layer and
                       never dispatches through ALL_ATTENTION_FUNCTIONS; checked in the mask hook,
                       before any layer runs)
    models that ask neither hook (DeBERTa, XLNet, XLM, OpenAI GPT, FSMT, ...) run their own
    attention, the same as "eager"; attnkit is never called (capture_attention says so).

``python tools/walk_transformers.py`` (in the repository) builds every installed model family tiny
and prints which are exact against "eager", which refuse, and which cannot be built tiny offline.

Static caches: ``generate(cache_implementation="static")`` works (equal to "eager"); transformers
builds that mask ahead of the forward and passes it through tensor-only code, so there the
dense mask is built (as for sdpa), and attnkit masks everywhere else.

One module per job, in this package: ``_refusals`` (what attnkit will not run), ``_mask_translation``
(the mask hook), ``_capture`` (exact weights of chosen layers), ``_forward`` (the attention hook);
``_hf`` is what they read of transformers itself. This module registers them.
"""

from __future__ import annotations

import contextlib

from ._capture import CaptureError, capture_attention, capturing
from ._forward import attnkit_attention_forward
from ._hf import NAME, import_transformers
from ._mask_translation import attnkit_mask
from ._mask_translation import checked_kinds as checked_kinds
from ._mask_translation import structured_mask as structured_mask
from ._refusals import UnsupportedModelError, register_refusals

__all__ = ["register", "attnkit_attention_forward", "attnkit_mask", "capture_attention", "capturing", "CaptureError",
           "UnsupportedModelError", "NAME"]


def register(name: str = NAME) -> str:
    """Register attnkit as ``attn_implementation=name`` (attention *and* mask function).

    Importing this module already registers ``"attnkit"`` (when transformers is installed); call
    this for another name, or to restore attnkit's functions under ``"attnkit"``. Idempotent.
    Returns the name to pass to ``from_pretrained(..., attn_implementation=name)``.

    Raises:
        ImportError: transformers is not installed (with how to install it).
    """
    transformers, masking_utils = import_transformers()
    transformers.AttentionInterface.register(name, attnkit_attention_forward)
    masking_utils.AttentionMaskInterface.register(name, attnkit_mask)
    register_refusals(name)
    return name


# Registered on import: importing the integration is the intent to run models on it, and a forgotten
# register() met only transformers' own error, which never names attnkit (docs/compatibility.md).
# Without transformers the import still succeeds; register() then raises the install hint.
with contextlib.suppress(ImportError):
    register()
