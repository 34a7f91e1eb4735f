"""Capture: exact attention weights of chosen layers and heads, recorded as a forward runs on attnkit.

Shape legend: B batch, H query heads, Hkv key/value heads, L query length,
S key length, D head dim, Dv value head dim.

:func:`capturing` opens a context in which the attention forward records ``{layer: (B, H', L, S)}``;
:func:`capture_attention` runs one forward in it. The weights are recomputed from lse for the
asked heads only (no switch to eager attention).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ._hf import NAME

__all__ = ["capturing", "capture_attention", "CaptureError", "ACTIVE"]


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


ACTIVE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("attnkit_capture", default=None)


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
    token = ACTIVE.set(cap)
    try:
        yield cap.weights
    finally:
        ACTIVE.reset(token)
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
