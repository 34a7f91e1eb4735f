"""The front door: ``attention`` and ``dispatch``."""

from __future__ import annotations

import types

import torch
import torch.fx as _fx
from torch import Tensor as _Tensor
from torch.compiler import is_compiling as _is_compiling

from . import _fast, score_mods
from ._dispatch import Decision, decide, explain_decision
from ._request import _check_dense, make_request, positive_scale
from .backends import _softmax
from .backends._tiles import weights_from_lse

__all__ = ["attention", "dispatch"]

_is_tracing = torch._C._is_tracing  # torch.jit.trace (torch.jit.is_tracing without its scripting check)
_tf_modes = torch._C._is_torch_function_mode_enabled  # any torch function mode (a default device sets one)


def attention(q, k, v, *, mask=None, causal=False, scale=None, score_mod=None, dropout_p=0.0,
              return_lse=False, return_weights=False, sinks=None, backend="auto"):
    r"""Exact scaled dot-product attention, ``softmax(q kᵀ · scale) v``.

    Shape legend: B batch, H query heads, Hkv key/value heads, L query length,
    S key length, D head dim, Dv value head dim.

    Args:
        q: ``(B, H, L, D)``, or unbatched ``(H, L, D)`` / ``(L, D)``.
        k: ``(B, Hkv, S, D)`` with ``H % Hkv == 0``; query head ``h`` uses kv head
            ``h // (H // Hkv)`` (GQA/MQA; K/V are never copied on the fast paths).
        v: ``(B, Hkv, S, Dv)``.
        mask: None; a bool array/tensor broadcastable to ``(B, H, L, S)`` (**True =
            attend**); a float array/tensor (an additive bias on the scaled scores); an
            :mod:`attnkit.masks` object; or a ``mask_mod(b, h, q_idx, kv_idx)``. Tensors
            broadcast from the right, as in NumPy: a 1-D ``(S,)`` mask applies to every query.
        causal: add a causal mask, **bottom-right aligned** when L ≠ S (query ``i``
            sees keys ``j <= i + S - L``)::

                L=2, S=4:   k0 k1 k2 k3
                        q0   #  #  #  .
                        q1   #  #  #  #

            For top-left alignment pass ``mask=attnkit.masks.causal("top_left")``.
        scale: multiplier of ``q kᵀ``; default ``1/√D``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` on the scaled
            scores (FlexAttention's signature), applied before bias and mask. An integer or
            bool result is promoted to the working precision, as FlexAttention does.
        dropout_p: dropout on the weights: ``eager`` and ``sdpa`` (not with ``return_lse``);
            ``auto`` picks ``eager``; the other backends refuse it.
        return_lse: also return ``lse (B, H, L)``, the log-sum-exp of each row.
        return_weights: also return the exact attention weights ``(B, H', L, S)``, recomputed
            from q, k and lse (``exp(s - lse)``) on whichever backend ran, so the fast path
            never holds an L×S tensor it does not return: ``True`` for every head, or a
            sequence of query-head indices (``H'`` of them). Rows sum to 1 (less the sink's
            share with ``sinks``); fully masked rows are 0. Differentiable. With dropout,
            the weights before dropout.
        sinks: attention sinks (GPT-OSS): per-head logits ``(H,)`` (or broadcastable to
            ``(B, H, L)``) added to each row's softmax denominator, attending to nothing::

                out = Σ_j e^(s_j) v_j / (e^sink + Σ_j e^(s_j)),   lse = log(e^sink + Σ_j e^(s_j))

            Gradients reach ``sinks``.
        backend: ``"auto"`` (see :func:`dispatch`), ``"reference"``, ``"eager"``,
            ``"sdpa"``, ``"tiled"`` or ``"flex"`` (FlexAttention with attnkit's BlockMask;
            inference only on a CPU). A named backend that cannot honour the
            arguments raises; it never falls back silently.

    Returns:
        ``out (B, H, L, Dv)`` in the input's kind (torch → torch with autograd,
        NumPy → NumPy), dtype and rank (under ``torch.autocast``, as torch SDPA: fp32 /
        fp16 / bf16 inputs computed and returned in autocast's dtype, float64 kept);
        or ``(out, lse)`` with ``return_lse=True``;
        ``(out, weights)`` or ``(out, lse, weights)`` with ``return_weights``.
        A fully masked query row gives output 0 and lse -inf (gradients 0), never NaN.
        NaN in an input propagates to the rows it touches.

    Raises:
        TypeError: a wrong kind of argument; the message names it, what was expected and what was got.
        ValueError: a wrong value or shape; the message names it, what was expected and what was got.
    """
    if _under_autocast(q):
        return _autocast(attention, q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod,
                         dropout_p=dropout_p, return_lse=return_lse, return_weights=return_weights, sinks=sinks,
                         backend=backend)
    if type(q) is not _Tensor and isinstance(q, _fx.Proxy):
        return _fx_leaf(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod, dropout_p=dropout_p,
                        return_lse=return_lse, return_weights=return_weights, sinks=sinks, backend=backend)
    if type(q) is _Tensor and q.is_meta:
        return _on_meta(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod, dropout_p=dropout_p,
                        return_lse=return_lse, return_weights=return_weights, sinks=sinks, backend=backend)
    if _is_compiling() or _is_tracing():
        # traced by torch.compile / torch.export / torch.jit.trace: one call of attnkit's torch op (attnkit._op); the
        # eager path reads sizes and values, which torch.jit.trace would record as constants of the traced call
        from . import _op

        return _op.attention(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod, dropout_p=dropout_p,
                             return_lse=return_lse, return_weights=return_weights, sinks=sinks, backend=backend)
    if _tf_modes() and _elsewhere_by_default(q):
        with torch.device("cpu"):  # the CPU paths' own buffers on the CPU, whatever the user's default device
            return attention(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod,
                             dropout_p=dropout_p, return_lse=return_lse, return_weights=return_weights, sinks=sinks,
                             backend=backend)
    if ((mask is None or type(mask) in _fast.MASKS or type(mask) is _Tensor)
            and type(backend) is str and backend == "auto" and return_lse is False
            and return_weights is False and sinks is None and type(dropout_p) is float and dropout_p == 0.0):
        try:
            out = _fast.attention(q, k, v, mask, causal, scale, score_mod)  # the common case, see its contract
        except RuntimeError:  # torch's error for an input the fast path does not look at (a sparse tensor, whose
            for n, t in (("q", q), ("k", k), ("v", v), ("mask", mask)):  # shape matched a learned call): named
                _check_dense(n, t)  # if it is that
            raise
        if out is not None:
            return out
    req = make_request(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod,
                       dropout_p=dropout_p, return_lse=return_lse, backend=backend,
                       return_weights=return_weights, sinks=sinks)
    if req.scale <= 0.0:  # the kernels take a scale > 0 (see positive_scale); explain() shows the call as given
        req.q, req.scale = positive_scale(req.q, req.scale)
    decision = explain_decision(req, backend)
    assert decision.kernel is not None
    out, lse = decision.kernel.run(req)
    if req.sinks is not None:
        out, lse = _softmax.add_sink(out, lse, req.sinks)
    weights = None
    if req.weight_heads is not None:
        weights = weights_from_lse(req, lse, req.weight_heads).to(req.q.dtype)  # (B, H', L, S)
    return _finish(req, out, lse, weights)


def _fx_leaf(q, k, v, **kw):
    """Under ``torch.fx.symbolic_trace`` (``q`` a Proxy): one node of the graph that calls :func:`attention` when the
    graph runs (a leaf: the eager path reads shapes and values a Proxy has not). Proxies among the keywords (a mask
    that is an input of the traced function) stay inputs of the node; the other arguments are held by it."""
    traced = {n: x for n, x in kw.items() if isinstance(x, _fx.Proxy)}
    held = {n: x for n, x in kw.items() if n not in traced}

    def attention(q, k, v, **inputs):  # (named so: the graph's code reads "attention(q, k, v)")
        return _attention(q, k, v, **held, **inputs)

    return q.tracer.create_proxy("call_function", attention, (q, k, v), traced)


def _on_meta(q, k, v, **kw):
    """``attention`` over meta tensors (shapes only, as a model built under ``torch.device("meta")`` runs): the
    arguments checked as on any device, then the results' shapes (with autograd) from the fake kernel of attnkit's
    torch op (:mod:`attnkit._op`); attention weights, if asked for, as an empty ``(B, H', L, S)``."""
    from . import _op

    with torch.no_grad():  # (with gradients on, a score_mod is probed for the tensors it reads: values, not shapes)
        req = make_request(q, k, v, **kw)
    # a mask or score_mod never changes the shapes: passed on only where the op takes it and it may read a tensor
    # that wants a gradient (a float mask; a function or built-in score_mod), else dropped
    mask = kw["mask"] if isinstance(kw["mask"], _Tensor) else None
    score_mod = kw["score_mod"]
    if not (score_mod is None or isinstance(score_mod, types.FunctionType)
            or type(score_mod) in (score_mods.Softcap, score_mods.RelativeBias, score_mods.Alibi)):
        score_mod = None
    out, lse = _op.attention(req.q, req.k, req.v, mask=mask, causal=kw["causal"], scale=req.scale,
                             score_mod=score_mod, return_lse=True, sinks=kw["sinks"])
    weights = None
    if req.weight_heads is not None:
        B, _, L, _ = req.q.shape
        weights = req.q.new_empty(B, len(req.weight_heads), L, req.k.shape[2])
    return _finish(req, out, lse, weights)


def _finish(req, out, lse, weights=None):
    """Back to the caller's rank and kind; the tuple the caller asked for."""
    if req.input_rank == 3:  # (H, L, D) in -> (H, L, Dv) out
        out, lse = out[0], (None if lse is None else lse[0])
        weights = None if weights is None else weights[0]
    elif req.input_rank == 2:  # (L, D) in -> (L, Dv) out
        out, lse = out[0, 0], (None if lse is None else lse[0, 0])
        weights = None if weights is None else weights[0, 0]
    if req.numpy_in:
        out = out.detach().cpu().numpy()
        lse = None if lse is None else lse.detach().cpu().numpy()
        weights = None if weights is None else weights.detach().cpu().numpy()
    res = (out,) + ((lse,) if req.return_lse else ()) + ((weights,) if req.weight_heads is not None else ())
    return res if len(res) > 1 else out


def dispatch(q, k, v, *, mask=None, causal=False, scale=None, score_mod=None, dropout_p=0.0,
             return_lse=False, return_weights=False, sinks=None, backend="auto") -> Decision:
    """The backend ``attention`` would run for these arguments, and why (runs nothing).

    >>> q = k = v = torch.randn(1, 2, 1024, 64)
    >>> d = attnkit.dispatch(q, k, v, mask=attnkit.masks.sliding_window(256))
    >>> d.backend
    'tiled'
    >>> d.worker in ("native", "fused")  # attnkit's compiled kernel; torch's flash kernel where it was not built
    True
    >>> print(d.reason)  # doctest: +NORMALIZE_WHITESPACE
    block-sparse tiled kernel for mask sliding_window(256, align='bottom_right')
    (SDPA would need a dense (B, H, L, S) mask)
    """
    if _under_autocast(q):
        return _autocast(dispatch, q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod,
                         dropout_p=dropout_p, return_lse=return_lse, return_weights=return_weights, sinks=sinks,
                         backend=backend)
    if _tf_modes() and _elsewhere_by_default(q):
        with torch.device("cpu"):  # (as attention: the decision reads masks into CPU buffers)
            return dispatch(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod, dropout_p=dropout_p,
                            return_lse=return_lse, return_weights=return_weights, sinks=sinks, backend=backend)
    req = make_request(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod,
                       dropout_p=dropout_p, return_lse=return_lse, backend=backend,
                       return_weights=return_weights, sinks=sinks)
    if req.q.is_meta:  # what attention() does with meta tensors (_on_meta): no backend runs
        return Decision(backend if isinstance(backend, str) else "auto",
                        "meta tensors (shapes only): no backend runs", "fake",
                        "attnkit's torch op's fake kernel: empty tensors of the results' shapes")
    return decide(req, backend)


# one C call, no argument parsing (the public torch.is_autocast_enabled(device) costs a few times more): asked on
# every call, the smallest ones included
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _elsewhere_by_default(q) -> bool:
    """Whether torch's default device is not the CPU (``torch.set_default_device``, ``with torch.device(...)``) while
    ``q`` is a CPU tensor: attnkit's CPU paths allocate buffers (outputs, the compiled kernel's row intervals and tile
    maps) without naming a device, and on the default device the kernel would write into memory it cannot reach (a
    meta tensor's null pointer: a crash). Such a call runs under ``torch.device("cpu")``."""
    return type(q) is _Tensor and q.device.type == "cpu" and torch.get_default_device().type != "cpu"


def _under_autocast(q) -> bool:
    """Whether ``torch.autocast`` is on for ``q``'s device (a torch tensor's; NumPy input never is)."""
    return _any_autocast() and type(q) is _Tensor and torch.is_autocast_enabled(q.device.type)


def _autocast(fn, q, k, v, **kw):
    """``fn`` (attention or dispatch) as torch SDPA runs under ``torch.autocast``: q, k, v in autocast's dtype
    (fp32 / fp16 / bf16 inputs cast to it; float64 kept, as autocast keeps it), then every backend computes in
    that dtype with autocast off inside — so the output's dtype never depends on which backend the size picked
    (SDPA would follow autocast, the compiled kernel and the eager paths would not)."""
    device = q.device.type
    dtype = torch.get_autocast_dtype(device)

    def cast(t):
        if isinstance(t, _Tensor) and t.is_floating_point() and t.dtype not in (dtype, torch.float64):
            return t.to(dtype)
        return t

    with torch.autocast(device, enabled=False):
        return fn(cast(q), cast(k), cast(v), **kw)


_attention = attention  # (for _fx_leaf, whose node function is named attention too)
