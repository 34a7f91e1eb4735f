"""Mask translation: the mask transformers asks for, as an :mod:`attnkit.masks` object.

Shape legend: B batch, H query heads, Hkv key/value heads, L query length,
S key length, D head dim, Dv value head dim.

transformers' mask hook (:func:`attnkit_mask`) reads the mask function it is handed (causal,
sliding window, chunked, bidirectional, packed documents) and the 2-D padding mask, and returns
the equivalent attnkit mask (:func:`structured_mask`), so no dense ``(B, 1, L, S)`` tensor is
built per step; anything it cannot say exactly is built densely, as transformers' ``sdpa_mask``
builds it. Each kind of mask function is checked once per process against the installed
transformers (:func:`checked_kinds`). :func:`resolve_mask` turns what a layer receives into
``attnkit.attention``'s ``mask`` and ``causal``.
"""

from __future__ import annotations

import contextvars
import inspect
import re
import sys
import types
import warnings
from typing import Any

import torch

from ... import masks as _masks
from ._hf import import_transformers, module_supports_sdpa
from ._refusals import check_asking_model, check_uses_attention_interface

__all__ = ["attnkit_mask", "structured_mask", "checked_kinds", "resolve_mask"]


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
    _, mu = import_transformers()
    composed = _COMPOSED.get()
    if composed is not None:  # the self-check asking which mask function transformers composes
        composed.append(mask_function)
        return None
    check_uses_attention_interface(kwargs.get("config"))
    check_asking_model()
    if mask_function is None:
        mask_function = mu.causal_mask_function
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(torch.bool)  # as transformers' own mask preprocessing does
    if not _honours_is_causal(kwargs.get("config")):
        # No mask is read as "the module's is_causal" (see resolve_mask); a model that does not
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
        _IS_CAUSAL_RIGHT[cls] = module_supports_sdpa(sys.modules.get(cls.__module__.replace(".configuration_",
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
    _, mu = import_transformers()
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
    _, mu = import_transformers()
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


def resolve_mask(module, query, key, attention_mask, is_causal):
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
