"""Hugging Face ``transformers`` running on attnkit, and exact weights from its fast path.

Shape legend: B batch, H query heads, Hkv key/value heads, L query length,
S key length, D head dim, Dv value head dim.

    >>> from attnkit.integrations import transformers as ak_hf
    >>> ak_hf.register()                                   # once per process
    >>> model = AutoModel.from_pretrained(path, attn_implementation="attnkit")
    >>> weights = ak_hf.capture_attention(model, tok(["The river bank."], return_tensors="pt"),
    ...                                   layers=[2], heads=[0, 5])
    >>> weights[2].shape                                   # (B, 2 heads, L, S)

How the pieces fit::

    model.forward ──► mask interface "attnkit" ──► bool (B, 1, L, S) mask, True = attend
                        (right padding is also tagged with its structured twin
                         attnkit.masks.padding(lengths), checked equal to the dense one)
                 ──► every attention layer: attnkit_attention_forward
                        attnkit.attention(q, k, v, mask=…, return_lse=capturing)  (auto backend)
                        capturing this layer? weights = exp(q kᵀ·scale − lse) for the chosen
                        heads only (no L×S tensor for the others, no switch to eager)

Registering only the attention function is not enough: transformers builds no
padding mask for an implementation missing from ``AttentionMaskInterface``, so a
padded batch would silently attend to its padding. ``register()`` adds both.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

from .. import masks as _masks
from .._request import make_request
from ..api import attention
from ..backends._common import weights_from_lse

__all__ = ["register", "attnkit_attention_forward", "attnkit_mask", "capture_attention", "capturing", "CaptureError",
           "NAME"]

NAME = "attnkit"
_TAG = "_attnkit_structured"  # attribute on the dense mask tensor: (structured mask, shape it stands for)


def _import_transformers():
    try:
        import transformers  # noqa: F401
        from transformers import masking_utils
    except ImportError as e:  # pragma: no cover - exercised by the CLI with transformers hidden
        raise ImportError(
            f"attnkit.integrations.transformers needs the 'transformers' package ({e}). "
            "Install the model extra: pip install 'attnkit[model]'"
        ) from e
    return transformers, masking_utils


def register(name: str = NAME) -> str:
    """Register attnkit as ``attn_implementation=name`` (attention *and* mask function).

    Idempotent. Returns the name to pass to ``from_pretrained(..., attn_implementation=name)``.
    """
    transformers, masking_utils = _import_transformers()
    transformers.AttentionInterface.register(name, attnkit_attention_forward)
    masking_utils.AttentionMaskInterface.register(name, attnkit_mask)
    return name


# ----------------------------------------------------------------------------------------------
# mask interface


def attnkit_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """transformers' mask hook for ``"attnkit"``: a bool ``(B, 1, L, S)`` mask (True = attend) or None.

    Builds the same mask as transformers' ``sdpa_mask`` (so any model's mask
    pattern is honoured). When the pattern is plain right padding (optionally
    causal), the tensor also carries the equivalent :mod:`attnkit.masks` object,
    verified equal to the dense mask, so attnkit can skip padded key blocks
    instead of reading an L×S tensor.
    """
    _, mu = _import_transformers()
    if mask_function is None:
        mask_function = mu.causal_mask_function
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(torch.bool)  # as transformers' own mask preprocessing does
    dense = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    if dense is None or not isinstance(dense, torch.Tensor) or dense.dtype != torch.bool or dense.dim() != 4:
        return dense
    structured = _structured_twin(mu, mask_function, attention_mask, dense, q_offset, kv_offset)
    if structured is not None:
        setattr(dense, _TAG, (structured, tuple(dense.shape)))
    return dense


def _structured_twin(mu, mask_function, attention_mask, dense, q_offset, kv_offset):
    """``masks.padding(lengths)`` (``& causal('top_left')``) if it equals ``dense`` exactly, else None."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    if not (isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0):
        return None
    B, _, L, S = dense.shape
    if attention_mask.shape != (B, S):
        return None
    valid = attention_mask.to(torch.bool)
    lengths = valid.sum(-1)
    if not torch.equal(valid, torch.arange(S, device=valid.device) < lengths[:, None]):
        return None  # left padding or holes: keep the dense mask
    if mask_function is mu.bidirectional_mask_function:
        cand = _masks.padding(lengths.cpu())
    elif mask_function is mu.causal_mask_function:
        cand = _masks.causal("top_left") & _masks.padding(lengths.cpu())  # q_offset 0: query i is position i
    else:
        return None
    if not torch.equal(cand.materialize(B, 1, L, S, device=dense.device), dense):
        return None
    return cand


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
    tag = getattr(attention_mask, _TAG, None)
    if tag is not None and tag[1] == tuple(attention_mask.shape):
        return tag[0], False
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
            expected = sorted(self.layers)
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
        inputs: a mapping of model inputs (e.g. a tokenizer's ``BatchEncoding``).
        layers: layer indices in ``0..num_hidden_layers-1`` (None = all).
        heads: head indices in ``0..num_attention_heads-1`` (None = all), the same for every chosen layer.

    Raises:
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
    with torch.no_grad(), capturing(layers, heads, model=model) as weights:
        model(**inputs)
    return dict(sorted(weights.items()))


# ----------------------------------------------------------------------------------------------
# attention interface


def attnkit_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                              is_causal=None, **kwargs):
    """transformers' attention hook for ``"attnkit"``.

    query ``(B, H, L, D)``, key/value ``(B, Hkv, S, D)`` (GQA is native: K/V are
    not repeated). Returns ``(out (B, L, H, Dv), weights (B, H, L, S) or None)``;
    weights are returned when the model asks for ``output_attentions`` (recomputed
    exactly from lse, not kept from the forward).
    """
    for unsupported in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"attn_implementation='attnkit' does not support {unsupported!r} yet; "
                             "load this model with attn_implementation='sdpa' or 'eager'.")
    mask, causal = _resolve_mask(module, query, key, attention_mask, is_causal)
    cap = _ACTIVE.get()
    layer, record, heads = None, False, None
    if cap is not None:
        layer = cap.layer_of(module)
        record = cap.layers is None or layer in cap.layers
        heads = cap.heads
        if record:
            cap.check_heads(query.shape[1])
    want_all = bool(kwargs.get("output_attentions", False))
    need_lse = want_all or record
    dropout_p = float(dropout) if module.training else 0.0
    if dropout_p > 0 and want_all:
        raise ValueError(
            f"output_attentions=True with attention dropout active (p={dropout_p}, the model is in train mode): "
            "attnkit returns exact weights without dropout, which would not be the ones this forward used. "
            "Call model.eval() first, or run without output_attentions.")
    if dropout_p > 0 and record:
        raise ValueError(f"capturing attention weights of layer {layer} with attention dropout active "
                         f"(p={dropout_p}, the model is in train mode) is not exact; call model.eval() first.")
    res = attention(query, key, value, mask=mask, causal=causal, scale=scaling, dropout_p=dropout_p,
                    return_lse=need_lse)
    out, lse = res if need_lse else (res, None)
    weights = None
    if need_lse:
        req = make_request(query, key, value, mask=mask, causal=causal, scale=scaling, score_mod=None,
                           dropout_p=0.0, return_lse=True, backend="auto")
        with torch.no_grad():
            if record:
                cap.weights[layer] = weights_from_lse(req, lse.detach(), heads)  # (B, H', L, S)
            if want_all:
                weights = weights_from_lse(req, lse.detach())  # (B, H, L, S)
    return out.transpose(1, 2).contiguous(), weights  # (B, L, H, Dv)
