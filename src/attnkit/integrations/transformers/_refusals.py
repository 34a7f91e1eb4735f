"""Refusals: what attnkit will not run, said before it could run half of it.

Shape legend: B batch, H query heads, Hkv key/value heads, L query length,
S key length, D head dim, Dv value head dim.

* models whose attention layers compute attention themselves (they would get only attnkit's
  mask): refused at construction through their ``*_ATTENTION_CLASSES`` dict
  (:func:`register_refusals`), or in the mask hook before the first layer runs
  (:func:`check_uses_attention_interface`);
* keyword arguments of the attention call: each is handled, known to be harmless, or refused,
  and an unknown one stops the call (:func:`check_kwargs`).
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import weakref

import torch

from ._hf import model_name, module_supports_sdpa

__all__ = ["UnsupportedModelError", "register_refusals", "check_uses_attention_interface", "check_asking_model",
           "check_kwargs", "alternatives", "describe"]

# ----------------------------------------------------------------------------------------------
# models that compute attention themselves: refused, never half-run (issue 18, item 2)

# Modeling modules that pick their attention layer class from a dict keyed by the implementation
# name (``FALCON_ATTENTION_CLASSES[config._attn_implementation]``), found by scanning
# transformers' source for ``_ATTENTION_CLASSES[`` (the walk test re-scans the installed
# version and fails when this list is incomplete). Without an entry for "attnkit" their
# constructor dies with a bare ``KeyError: 'attnkit'``; register() adds an entry that raises
# the clear error instead, through the dict transformers itself looks the name up in.
_CLASS_DICT_MODULES = ("falcon.modeling_falcon", "gptj.modeling_gptj", "gpt_neo.modeling_gpt_neo",
                       "bark.modeling_bark", "git.modeling_git", "sam.modeling_sam", "sam_hq.modeling_sam_hq",
                       "data2vec.modeling_data2vec_vision", "superglue.modeling_superglue",
                       "deepseek_ocr2.modeling_deepseek_ocr2", "unlimited_ocr.modeling_unlimited_ocr")


_REFUSALS_REGISTERED: set = set()


class UnsupportedModelError(ValueError):
    """A transformers model that computes attention in its own layers instead of calling
    transformers' attention interface: attnkit cannot run it (it would only get the mask)."""


def _refusal(model: str, where: str, alternatives: list) -> str:
    alt = "attn_implementation='eager'" + ("".join(f" (or {a!r})" for a in alternatives if a != "eager"))
    return (f"attn_implementation='attnkit': {model} is not supported: its attention layers ({where}) compute "
            "attention themselves and never call transformers' attention interface, so attnkit would at most "
            "supply their mask, and the result would be neither attnkit's nor the model's. "
            f"Load this model with {alt}.")


def register_refusals(name: str):
    import importlib

    for mod_name in _CLASS_DICT_MODULES:
        if (mod_name, name) in _REFUSALS_REGISTERED:
            continue
        _REFUSALS_REGISTERED.add((mod_name, name))
        try:
            mod = importlib.import_module(f"transformers.models.{mod_name}")
        except ImportError:  # not in this transformers version (or an optional dependency is missing)
            continue
        for attr, table in list(vars(mod).items()):
            if attr.endswith("_ATTENTION_CLASSES") and isinstance(table, dict) and name not in table:
                table[name] = _refusing_layer(model_name(mod), f"{mod.__name__}.{attr}",
                                              [k for k in ("sdpa",) if k in table])


def _refusing_layer(model: str, where: str, alternatives: list):
    def refuse(*args, **kwargs):
        raise UnsupportedModelError(_refusal(model, where, alternatives))
    return refuse


_OWN_ATTENTION: dict = {}


def check_uses_attention_interface(config):
    """Raise :class:`UnsupportedModelError` when the model of ``config`` computes attention in its
    own layers: its modeling module defines an attention layer (a ``class *Attention*(nn.Module)``)
    and never dispatches through ``ALL_ATTENTION_FUNCTIONS``.

    Such a model (Bloom, MPT, CodeGen, XGLM, MPNet, RoFormer, ...) accepts
    ``attn_implementation="attnkit"`` and asks attnkit's mask hook for its mask, but adds what it
    gets to its own scores: None read as "no mask", a bool mask added as a float bias — wrong
    logits with no error. This is the same test transformers itself makes before letting
    ``set_attn_implementation`` switch a model (``_can_set_attn_implementation``); a model made
    of sub-models (no attention layer of its own) is judged by theirs, which ask with their own
    config. Called by the mask hook, which runs before any attention layer of the forward.
    """
    if config is None:
        return
    cls = type(config)
    if cls not in _OWN_ATTENTION:
        mod = sys.modules.get(cls.__module__.replace(".configuration_", ".modeling_"))
        verdict = None
        try:
            src = inspect.getsource(mod) if mod is not None else ""
        except (OSError, TypeError):  # no source to read: do not guess
            src = ""
        if mod is not None and re.search(r"^class \w*Attention\w*\(nn\.Module\):", src, re.MULTILINE) and \
                "ALL_ATTENTION_FUNCTIONS" not in src:
            sdpa = module_supports_sdpa(mod)
            verdict = _refusal(model_name(mod), mod.__name__, ["sdpa"] if sdpa else [])
        _OWN_ATTENTION[cls] = verdict
    if _OWN_ATTENTION[cls] is not None:
        raise UnsupportedModelError(_OWN_ATTENTION[cls])


# Where a modeling module mixes both kinds (BigBird-Pegasus: an encoder that computes its own attention, a decoder
# that calls the interface; Informer: ProbSparse layers or interface ones, by config; Gemma 4: an audio encoder of
# its own beside the text model), the module-wide test above passes, and the model that asks for the mask is
# judged by the layers it holds: found up the stack from the mask hook, once per model object.
_INTERFACE_NAMES = ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "eager_attention_forward")
_COMPUTES_ITSELF: dict = {}  # layer class -> whether it takes the mask and computes attention itself
_MODEL_VERDICT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model object -> refusal text or None


def _computes_itself(cls) -> bool:
    """Whether ``cls`` is one of transformers' attention layers that takes an ``attention_mask`` and computes the
    softmax itself (its source never reaches the attention interface): it would add attnkit's bool mask to its
    scores as a number (+0 where the mask hides a key)."""
    verdict = _COMPUTES_ITSELF.get(cls)
    if verdict is None:
        verdict = False
        if cls.__module__.startswith("transformers.models.") and "Attention" in cls.__name__:
            owner = next((c for c in cls.__mro__ if "forward" in vars(c)), None)
            try:
                src = inspect.getsource(cls) + ("" if owner in (None, cls) else inspect.getsource(owner))
            except (OSError, TypeError):  # no source to read: do not guess
                src = ""
            head = re.search(r"def forward\((.*?)\)", src, re.S)
            verdict = bool(head and "attention_mask" in head.group(1) and "softmax" in src
                           and not any(n in src for n in _INTERFACE_NAMES))
        _COMPUTES_ITSELF[cls] = verdict
    return verdict


def check_asking_model(depth: int = 12) -> None:
    """Raise :class:`UnsupportedModelError` when the model whose forward asked for a mask (the nearest
    ``nn.Module`` up the stack) holds an attention layer that computes attention itself (:func:`_computes_itself`).
    Called by the mask hook."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return
        model = frame.f_locals.get("self")
        if isinstance(model, torch.nn.Module):
            break
        frame = frame.f_back
    else:
        return
    try:
        verdict = _MODEL_VERDICT[model]
    except KeyError:
        own = sorted({type(m).__name__ for m in model.modules() if _computes_itself(type(m))})
        verdict = None
        if own:
            mod = sys.modules.get(type(model).__module__)
            verdict = _refusal(type(model).__name__, ", ".join(own),
                               ["sdpa"] if mod is not None and module_supports_sdpa(mod) else [])
        _MODEL_VERDICT[model] = verdict
    if verdict is not None:
        raise UnsupportedModelError(verdict)


# ----------------------------------------------------------------------------------------------
# attention interface: every keyword argument is either handled, known to be harmless, or refused

# Passed by transformers' models and layers, and no change to the math of eager/sdpa attention here.
_HARMLESS = {
    "output_hidden_states": "a flag for transformers' output recorder",
    "output_router_logits": "a flag for MoE routers",
    "num_items_in_batch": "loss normalisation",
    "use_cache": "a cache flag (the cache is updated before attention)",
    "return_dict": "an output-format flag",
    "position_ids": "positions (rotary embeddings are applied before attention; packed sequences reach the mask)",
    "seq_idx": "packed-sequence ids for state-space layers (packing reaches attention through the mask)",
    "deterministic": "a flash-attention determinism switch",
    "max_length_q": "flash-attention varlen bookkeeping (the lengths themselves are cu_seq_lens_q/k)",
    "max_length_k": "flash-attention varlen bookkeeping (the lengths themselves are cu_seq_lens_q/k)",
    "encoder_hidden_states": "encoder states passed through a layer (cross-attention projects them into key/value)",
    "encoder_attention_mask": "passed through a layer (cross-attention gets it as attention_mask)",
    "past_key_values": "the KV cache (updated by the layer before attention)",
    "past_key_value": "the KV cache (updated by the layer before attention)",
    "cache_position": "cache bookkeeping (positions reach attention through the mask)",
    "position_embeddings": "rotary cos/sin (applied to q and k before attention)",
}


# Known, would change the math, and not implemented: refused whenever they are not None.
_REFUSED = {
    "indices": "top-k key indices of DeepSeek-style sparse attention (DSA); the model's eager path folds them "
               "into the mask, attnkit would attend to every key",
    "block_indices": "selected key blocks of block-sparse attention; the model's eager path folds them into "
                     "the mask, attnkit would attend to every key",
    "cache": "a paged KV cache (continuous batching) that attention must update itself",
}


# Handled in attnkit_attention_forward (named parameters, or read from kwargs).
_HANDLED = ("dropout", "scaling", "is_causal", "sliding_window", "softcap", "position_bias", "s_aux", "sinks",
            "output_attentions", "cu_seq_lens_q", "cu_seq_lens_k")


def alternatives(module) -> str:
    """``'eager'``, plus ``'sdpa'`` only when transformers allows sdpa for this model (``_supports_sdpa``)."""
    return "attn_implementation='eager'" + (" (or 'sdpa')" if _model_supports_sdpa(module) else "")


def _model_supports_sdpa(module) -> bool:
    """Whether every ``PreTrainedModel`` class next to ``module``'s class declares ``_supports_sdpa = True``."""
    return module_supports_sdpa(sys.modules.get(type(module).__module__))


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return repr(x) if len(repr(x)) <= 40 else type(x).__name__


def check_kwargs(module, kwargs):
    """Raise on any keyword argument that attnkit neither handles nor knows to be harmless."""
    where = type(module).__name__
    for name, val in kwargs.items():
        if name in _HARMLESS or name in _HANDLED:
            continue
        if name in _REFUSED:
            if val is None:
                continue
            raise ValueError(
                f"{name}: attn_implementation='attnkit' expected {name}=None, got {describe(val)} from {where} "
                f"({_REFUSED[name]}). attnkit does not implement it and will not run dense attention in its "
                f"place; load this model with {alternatives(module)}.")
        raise ValueError(
            f"{name}: attn_implementation='attnkit' got the keyword argument {name}={describe(val)} from {where}, "
            "which it does not know; rather than ignore something that may change the attention, it stops. "
            f"Load this model with {alternatives(module)}, or report the argument to attnkit "
            f"(known: {', '.join(sorted(set(_HANDLED) | set(_HARMLESS) | set(_REFUSED)))}).")
