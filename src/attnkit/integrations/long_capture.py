"""Every layer's post-RoPE q and k of a transformers model on a long input, in O(L) memory.

Shape legend: B batch (1 here), H query heads, Hkv key/value heads, L query length,
S key length (= L: one forward, no cache), D head dim.

What the long-input view needs from a model is the q and k its attention multiplies, not
the weights: :func:`attnkit.tile_mass` turns them into the exact mass per tile without
ever holding an L×S tensor. ``capture_attention`` (the weights, ``(B, H, L, S)`` per
layer) cannot do that at 32k tokens: one layer's weights alone are 4 GiB per head. So::

    model.forward ──► every attention layer: the hook registered as "attnkit_long"
                        q (1, H, L, D), k (1, Hkv, S, D)   rotary embeddings already applied
                        the mask and scale this layer uses  (attnkit's mask hook: no dense mask)
                      ──► kept in a LayerQK (references, no copy)
                      ──► attnkit_attention_forward(...)  the real attention, attnkit's fast path,
                                                          so the next layer sees the true input
                    the deepest layer wanted: stop there (its attention output feeds nothing
                    the view needs: no later q, k, no logits)

Memory: the model, its activations for one layer, and q, k of every captured layer
(``L·(H + Hkv)·D`` values each): O(L), never O(L²). The LM head is never run (the base
model is called), so no ``(L, vocab)`` logits either.

    >>> from attnkit.integrations import long_capture                      # needs transformers
    >>> cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
    ...        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000}
    >>> model = long_capture.build_from_config(cfg, seed=0)                # doctest: +SKIP
    >>> layers = long_capture.capture_qk(model, torch.randint(0, 32000, (1, 4096)))  # doctest: +SKIP
    >>> layers[1].q.shape, layers[1].k.shape, layers[1].causal            # doctest: +SKIP
    (torch.Size([1, 4, 4096, 64]), torch.Size([1, 2, 4096, 64]), True)
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["LayerQK", "LoadedModel", "capture_qk", "load_causal_lm", "build_from_config", "register",
           "NAME", "WEIGHT_PATTERNS"]

NAME = "attnkit_long"  # the attn_implementation the capture runs under (attnkit's mask hook, a capturing layer)
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass
class LayerQK:
    """One attention layer's inputs to its softmax, as the model ran it.

    Attributes:
        layer: the layer index (the module's ``layer_idx``, else the order of the calls).
        q: ``(1, H, L, D)``, after the rotary embedding; the model's dtype (a reference, not a copy).
        k: ``(1, Hkv, S, D)``, likewise.
        mask: what this layer attends under, as :func:`attnkit.attention` takes it: an
            :mod:`attnkit.masks` object, a bool / float ``(B, 1, L, S)`` tensor where the model
            built one, or None.
        causal: bottom-right causal on top of ``mask`` (a plain causal LM: None and True).
        scale: the scale the model passed (None: ``1/√D``).
        score_mod: ``attnkit.score_mods.softcap(c)`` for a model with attention softcapping, else None.
    """

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    mask: Any
    causal: bool
    scale: float | None
    score_mod: Any = None


@dataclass
class _Recorder:
    stop_after: int | None
    layers: list = field(default_factory=list)
    seen: set = field(default_factory=set)


class _Stop(Exception):
    """Raised by the hook once the deepest wanted layer's q and k are kept: the rest of the forward is not needed."""


_ACTIVE: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("attnkit_long_capture", default=None)


def _ak():
    from . import transformers as ak_hf

    return ak_hf


def _transformers():
    """The transformers package (ImportError with the install hint when missing)."""
    from .transformers._hf import import_transformers

    return import_transformers()[0]


def _capturing_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention hook for ``"attnkit_long"``: keep q and k, then run attnkit's own hook."""
    ak_hf = _ak()
    rec = _ACTIVE.get()
    if rec is None:  # the model used outside a capture: plain attnkit
        return ak_hf.attnkit_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"input_ids: the long-input capture takes one sequence (B = 1), got B = {query.shape[0]}. "
                         "Pass a (1, L) or (L,) tensor of token ids.")
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} passes {name} to its attention: the tile-mass view shows softmax(q kᵀ) "
                f"over the keys, and {name} changes those weights (a sink's share, or a bias), which it does not "
                "model. Models with attention sinks or a position bias are not supported by the long-input view.")
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, bool) or not isinstance(idx, int):
        idx = len(rec.layers)
    if idx in rec.seen:
        raise RuntimeError(f"capture_qk: layer {idx} ran twice in one forward; the long-input view captures one "
                           "forward of a model that calls each attention layer once.")
    rec.seen.add(idx)
    from .transformers._mask_translation import resolve_mask
    from .transformers._refusals import check_kwargs

    check_kwargs(module, kwargs)
    mask, causal = resolve_mask(module, query, key, attention_mask, kwargs.get("is_causal"))
    softcap = kwargs.get("softcap")
    score_mod = None
    if softcap is not None:
        from .. import score_mods

        score_mod = score_mods.softcap(softcap)
    scale = kwargs.get("scaling")
    rec.layers.append(LayerQK(layer=idx, q=query.detach(), k=key.detach(), mask=mask, causal=bool(causal),
                              scale=None if scale is None else float(scale), score_mod=score_mod))
    if rec.stop_after is not None and idx >= rec.stop_after:
        raise _Stop
    return ak_hf.attnkit_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Register ``"attnkit_long"`` with transformers: attnkit's mask hook and the capturing attention hook.

    Idempotent; returns the name. :func:`capture_qk` calls it (and switches the model to it for
    the one forward), so a user rarely needs to.
    """
    from .transformers._hf import import_transformers

    ak_hf = _ak()
    transformers, masking_utils = import_transformers()
    # attnkit's mask hook (structured masks, no dense (B, 1, L, S)) and the capturing layer. Not
    # ak_hf.register(NAME): its refusal entries import a dozen modeling modules (seconds); a model
    # that picks its attention class by name fails at construction instead, turned into a clear
    # error by _construct.
    masking_utils.AttentionMaskInterface.register(NAME, ak_hf.attnkit_mask)
    transformers.AttentionInterface.register(NAME, _capturing_forward)
    return NAME


def _own_attention(what: str) -> str:
    return (f"model: {what} computes attention in its own layers (it picks its attention class by name and never "
            "calls transformers' attention interface), so its q and k cannot be captured for the long-input view. "
            "Models on the attention interface work: Llama, Mistral, Qwen, Gemma, Phi, GPT-2, ...")


def _construct(fn, what: str):
    """``fn()`` (a from_config / from_pretrained call), with the errors of a model the view cannot run made clear."""
    try:
        return fn()
    except KeyError as e:
        if e.args and e.args[0] == NAME:
            raise ValueError(_own_attention(what)) from None
        raise
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ValueError(f"model: {what} is not a causal language model: transformers' AutoModelForCausalLM has "
                             "no class for it. Pass a decoder (causal LM) such as Llama, Mistral, Qwen or GPT-2.") \
                from None
        raise


def _check_ids(input_ids) -> torch.Tensor:
    if isinstance(input_ids, (list, tuple)):
        input_ids = torch.tensor(input_ids)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype in (torch.bool,) or input_ids.is_floating_point() \
            or input_ids.is_complex():
        raise TypeError(f"input_ids: expected an integer tensor of token ids, (L,) or (1, L), got "
                        f"{type(input_ids).__name__}"
                        + (f" of dtype {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) else "")
                        + ". Tokenize the text first (tok(text, return_tensors='pt').input_ids).")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids: expected one sequence, (L,) or (1, L) with L >= 1, got shape "
                         f"{tuple(input_ids.shape)}. The long-input view takes one sequence.")
    return input_ids.long()


def capture_qk(model, input_ids, *, layers: int | None = None) -> list[LayerQK]:
    """Run ``model`` once on ``input_ids`` and return every attention layer's post-RoPE q and k.

    Shape legend: H query heads, Hkv key/value heads, L tokens, D head dim.

    Args:
        model: a transformers model whose attention layers call transformers' attention interface
            (Llama, Mistral, Qwen, Gemma, Phi, GPT-2, ...). Any ``attn_implementation``: it is switched to
            ``"attnkit_long"`` for this forward and switched back after.
        input_ids: ``(L,)`` or ``(1, L)`` integer token ids.
        layers: keep the first ``layers`` layers only (None: all); the forward stops after the last one kept.

    Returns:
        ``[LayerQK, ...]`` in layer order: ``q (1, H, L, D)``, ``k (1, Hkv, L, D)``, the mask, causal flag,
        scale and score_mod that layer used. The forward runs under ``torch.no_grad()``, on attnkit's fast
        path; the LM head is not run.

    Raises:
        TypeError / ValueError: bad ``input_ids`` or ``layers``; a model whose attention takes sinks or a
            position bias (the view would not be exact).
        ValueError: no layer called the attention interface (the model computes attention itself).
    """
    ids = _check_ids(input_ids)
    cfg = getattr(model, "config", None)
    n_layers = getattr(cfg, "num_hidden_layers", None)
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise ValueError(f"layers: expected None (all) or an int >= 1, got {layers!r}.")
    vocab = getattr(cfg, "vocab_size", None)
    if isinstance(vocab, int) and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"input_ids: expected token ids in 0..{vocab - 1} (the model's vocab_size {vocab}), got "
                         f"ids from {int(ids.min())} to {int(ids.max())}.")
    last = None
    if isinstance(n_layers, int):
        last = n_layers - 1 if layers is None else min(n_layers, layers) - 1
    elif layers is not None:
        last = layers - 1
    name = register()
    prev = getattr(cfg, "_attn_implementation", None)
    switched = prev != name
    if switched:
        model.set_attn_implementation(name)
        if getattr(model.config, "_attn_implementation", None) != name:
            raise ValueError(f"model: {type(model).__name__} cannot switch its attention implementation "
                               "(it does not follow transformers' attention interface), so its q and k cannot be "
                               "captured.")
    rec = _Recorder(stop_after=last)
    token = _ACTIVE.set(rec)
    base = getattr(model, "base_model", model)  # the decoder without the LM head: no (L, vocab) logits
    try:
        with torch.no_grad(), contextlib.suppress(_Stop):  # _Stop: the deepest wanted layer is kept
            base(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        _ACTIVE.reset(token)
        if switched and prev is not None:
            model.set_attn_implementation(prev)
    if not rec.layers:
        raise ValueError(
            f"model: no attention layer of {type(model).__name__} called transformers' attention interface, "
            "so there is no q, k to show: this model computes attention in its own layers. The long-input view "
            "needs a model on the attention interface (Llama, Mistral, Qwen, Gemma, Phi, GPT-2, ...).")
    out = sorted(rec.layers, key=lambda x: x.layer)
    return out if layers is None else out[:layers]


# ----------------------------------------------------------------------------------------------
# loading


@dataclass
class LoadedModel:
    """What :func:`load_causal_lm` found: ``model`` (eval mode, on ``"attnkit_long"``), ``tokenizer``
    (None when the directory has none), ``name`` (for titles), ``random_weights`` (built from the
    config), ``seed``."""

    model: Any
    tokenizer: Any
    name: str
    random_weights: bool
    seed: int | None


def _has_weights(d: Path) -> bool:
    return any(any(d.glob(p)) for p in WEIGHT_PATTERNS)


def build_from_config(config, *, seed: int = 0):
    """A causal LM with random weights from ``config`` (a ``PretrainedConfig``, a dict with ``model_type``,
    or the path of a config.json), seeded: the same seed gives the same weights. The global RNG is left
    as it was. Eval mode, on ``"attnkit_long"``."""
    transformers = _transformers()
    if isinstance(config, (str, Path)):
        config = _config_from_file(Path(config))
    elif isinstance(config, dict):
        config = _config_from_dict(dict(config), "config")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {seed!r}.")
    name = register()
    what = f"{type(config).__name__} (model_type {getattr(config, 'model_type', None)!r})"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _construct(lambda: transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name),
                           what)
    model._attnkit_from_config_seed = seed  # so a page made from this model says its weights are random
    return model.eval()


def _config_from_dict(d: dict, where: str):
    transformers = _transformers()
    mt = d.pop("model_type", None)
    if not isinstance(mt, str):
        raise ValueError(f"{where}: expected a transformers config with a \"model_type\" (e.g. \"llama\"), got "
                         f"{'none' if mt is None else repr(mt)}.")
    try:
        return transformers.AutoConfig.for_model(mt, **d)
    except ValueError as e:
        raise ValueError(f"{where}: model_type {mt!r} is not one this transformers knows ({e}).") from None


def _config_from_file(p: Path):
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"config: cannot read {str(p)!r} as a JSON config ({e}).") from None
    if not isinstance(d, dict):
        raise ValueError(f"config: expected a JSON object in {str(p)!r}, got {type(d).__name__}.")
    return _config_from_dict(d, str(p))


def _tokenizer(d: Path):
    """The directory's tokenizer, or None when it has none (a config-only directory)."""
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                            "vocab.json", "vocab.txt", "spiece.model")):
        return None
    transformers = _transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError, TypeError, ImportError):
        return None


def load_causal_lm(path, *, from_config: bool = False, seed: int = 0) -> LoadedModel:
    """A transformers causal LM from ``path`` for the long-input view (offline, eval mode, on ``"attnkit_long"``).

    ``path`` is a model directory (config.json and weights) or a config.json file:

    * a directory with weights: ``AutoModelForCausalLM.from_pretrained`` (its trained weights);
    * a config.json file, or a directory with ``from_config=True``: the model built from the config
      with random weights, seeded by ``seed`` (the same seed, the same weights);
    * a directory with a config.json and no weights, without ``from_config``: ValueError saying so
      (random weights are never used unless asked for).

    The tokenizer is loaded when the directory has one (None otherwise: pass token ids).
    """
    if not isinstance(from_config, bool):
        raise TypeError(f"from_config: expected True or False, got {from_config!r}.")
    p = Path(path)
    if not p.exists():
        raise ValueError(f"model: expected a transformers model directory (config.json and weights) or a "
                         f"config.json file, got {str(p)!r}, which does not exist.")
    if p.is_file():
        d = p.parent
        model = build_from_config(p, seed=seed)
        return LoadedModel(model, _tokenizer(d), d.name or p.name, True, seed)
    if not (p / "config.json").is_file():
        raise ValueError(f"model: {str(p)!r} has no config.json; expected a transformers model directory "
                         "(config.json and weights) or the path of a config.json file.")
    if from_config:
        model = build_from_config(p / "config.json", seed=seed)
        return LoadedModel(model, _tokenizer(p), p.resolve().name, True, seed)
    if not _has_weights(p):
        raise ValueError(
            f"model: {str(p)!r} has a config.json but no weights (no {' / '.join(WEIGHT_PATTERNS)}). To see a "
            "model with random weights built from that config, ask for it: from_config=True (attnkit long: "
            "--from-config, seeded by --seed); otherwise point at a directory that holds the weights.")
    transformers = _transformers()
    name = register()
    model = _construct(lambda: transformers.AutoModelForCausalLM.from_pretrained(
        str(p), attn_implementation=name, local_files_only=True), repr(str(p)))
    return LoadedModel(model.eval(), _tokenizer(p), p.resolve().name, False, None)
