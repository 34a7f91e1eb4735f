"""The one validation point: public arguments in, a normalised ``Request`` out.

Every backend receives a ``Request`` (defined in ``backends._base``) whose tensors are already 4-D torch
tensors of one floating dtype on one device, with the mask resolved into at
most three parts that are ANDed together:

* ``mask``       a structured :class:`attnkit.masks.Mask` (causal folded in);
* ``dense_mask`` a user bool tensor, 4-D, broadcastable to ``(B, H, L, S)``;
* ``bias``       a user float tensor added to the scaled scores, same shape rule.

The order of operations every backend follows (and the reference spells out)::

    s = (q @ kᵀ) * scale            # scaled scores   (B, H, L, S)
    s = score_mod(s, b, h, i, j)    # optional
    s = s + bias                    # optional float mask
    s = where(mask & dense_mask, s, -inf)
    p = softmax(s)   (a row with no finite score gives p = 0, lse = -inf)
    out = p @ v
"""

from __future__ import annotations

import math
import operator

import numpy as np
import torch

from . import _mods
from . import masks as _masks
from . import plans as _plans
from . import score_mods as _score_mods
from ._blockmask import block_mask_plan, is_block_mask
from .backends._base import Request

__all__ = ["Request", "make_request", "check_score_mod", "BACKENDS"]

BACKENDS = ("auto", "reference", "eager", "sdpa", "tiled", "flex")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _kind(x) -> str:
    if isinstance(x, torch.Tensor):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    return type(x).__name__


def _to_torch(name: str, x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if (x.dtype.kind == "f" and x.dtype.itemsize in (2, 4, 8)) or (x.dtype == np.bool_ and name == "mask"):
            return _from_numpy(x)
        if name == "mask":
            raise TypeError(_int_mask_message(x.dtype))
        raise TypeError(
            f"{name}: expected a floating-point array (float16/32/64), got dtype {x.dtype}. "
            f"Convert explicitly, e.g. {name}.astype(np.float32)."
        )
    raise _not_an_array(name, x)


def _not_an_array(name: str, x) -> TypeError:
    """The error for ``name`` given as something that is neither a tensor nor an array (a list, a scalar), with the
    conversion to make."""
    dt = "bool" if name == "mask" else "np.float32"  # (a mask's usual kind: True attends)
    return TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}. "
                     f"Convert it first, e.g. np.asarray({name}, dtype={dt}) or torch.as_tensor({name}).")


def _from_numpy(x: np.ndarray) -> torch.Tensor:
    """The array as a tensor sharing its memory where it is C-contiguous and writable; else a C-contiguous copy. A
    read-only array (a read-only memmap, ``np.frombuffer`` of bytes, ``np.broadcast_to``) is copied: torch shares
    it only with a warning the caller can do nothing about (attnkit never writes to an input)."""
    if not x.flags.writeable:
        return torch.from_numpy(np.array(x, order="C"))
    return torch.from_numpy(np.ascontiguousarray(x))


_F32_MAX = float(torch.finfo(torch.float32).max)


def positive_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """``(q, scale)`` with ``scale > 0`` and the same scores. Every kernel hides a key by writing -inf over its raw
    score and scales after (-inf · 0 is NaN, -inf · (-a) is +inf: a hidden key would win), so a scale <= 0 is
    rewritten exactly: ``(q·k)·(-a) = ((-q)·k)·a`` (negation is exact in floating point), and
    ``(q·k)·0 = ((q·0)·k)·1`` (0 for finite q and k, NaN where an inf meets it, as before). The gradient reaches
    the caller's ``q`` through the rewrite (autograd)."""
    if scale > 0.0:
        return q, scale
    return (-q, -scale) if scale < 0.0 else (q * 0.0, 1.0)


def _scale_value(scale) -> float:
    """``scale`` as a Python float: a real number (int, float, or a NumPy scalar of either kind), finite."""
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        hint = (" For a tensor's value pass float(scale); a learnable temperature is a score_mod "
                "(lambda s, b, h, q, kv: s * t)." if isinstance(scale, torch.Tensor) else "")
        raise TypeError(f"scale: expected a real number (default 1/sqrt(D)), got {scale!r}.{hint}")
    value = float(scale)
    if not abs(value) < math.inf:  # (not math.isfinite: a compiled function's float argument is symbolic)
        raise ValueError(f"scale: expected a finite number, got {scale!r}. Leave it out for 1/sqrt(D).")
    return value


def _int_mask_message(dtype) -> str:
    # A 0/1 integer mask means keep/drop; turning it into floats would make it a bias of
    # 0 and 1 (everything attended), so the fix offered is the bool conversion.
    return (
        f"mask: expected a bool mask (True = attend) or a float additive bias, got integer dtype {dtype}. "
        "If it holds 1 = attend / 0 = masked, convert it with mask.astype(bool) (NumPy) or mask.bool() "
        "(torch); if it is an additive bias, convert it to q's float dtype. attnkit does not guess which."
    )


def _lift(t: torch.Tensor, rank: int) -> torch.Tensor:
    if rank == 2:
        return t.unsqueeze(0).unsqueeze(0)
    if rank == 3:
        return t.unsqueeze(0)
    return t


_RANK_NAMES = {2: "(L, D)", 3: "(H, L, D)", 4: "(B, H, L, D)"}


def _check_qkv(q, k, v):
    # The common case in a few attribute reads (4-D torch tensors that fit together); anything
    # else, including every error, takes the full checks below with their messages.
    T = torch.Tensor
    if type(q) is T and type(k) is T and type(v) is T and q.dim() == 4 and k.dim() == 4 and v.dim() == 4:
        dt = q.dtype
        if dt in _FLOATS and k.dtype == dt and v.dtype == dt and q.device == k.device == v.device:
            B, H, L, D = q.shape
            Bk, Hkv, S, Dk = k.shape
            Bv, Hv, Sv, _ = v.shape
            if B == Bk == Bv and D == Dk and S == Sv and Hkv == Hv and Hkv and H % Hkv == 0 and S and D \
                    and not (q.is_neg() or k.is_neg() or v.is_neg()):
                return q, k, v, 4, False
    return _check_qkv_full(q, k, v)


def _check_dense(name: str, t) -> None:
    """A sparse or nested torch tensor refused by name (its layout reached torch's reshape / contiguous with
    their own messages, or, nested, was blamed for a batch mismatch)."""
    if not isinstance(t, torch.Tensor):
        return
    if t.is_nested:
        raise TypeError(f"{name}: expected a dense tensor, got a nested tensor (layout {t.layout}). Pad the "
                        "sequences to one length and pass a padding mask: attnkit.masks.padding(lengths) for "
                        "keys, or a document mask over packed rows (attnkit.masks.document(ids)).")
    if t.layout is not torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}. Convert it with "
                        f"{name}.to_dense().")


def _check_qkv_full(q, k, v):
    kinds = {_kind(q), _kind(k), _kind(v)}
    if not kinds <= {"torch", "numpy"}:
        bad = next(n for n, x in (("q", q), ("k", k), ("v", v)) if _kind(x) not in ("torch", "numpy"))
        raise _not_an_array(bad, {"q": q, "k": k, "v": v}[bad])
    if len(kinds) > 1:
        raise TypeError(
            f"q, k, v: expected all torch tensors or all NumPy arrays, got q={_kind(q)}, k={_kind(k)}, "
            f"v={_kind(v)}. Convert them to one kind (torch.from_numpy or tensor.numpy())."
        )
    numpy_in = kinds == {"numpy"}
    for n, x in (("q", q), ("k", k), ("v", v)):
        _check_dense(n, x)
    # a lazily negated tensor (torch._neg_view; its memory holds -x) read as its values: the kernels read memory
    q, k, v = (_to_torch(n, x).resolve_neg() for n, x in (("q", q), ("k", k), ("v", v)))
    for n, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _FLOATS:
            raise TypeError(
                f"{n}: expected a floating dtype (float16, bfloat16, float32, float64), got {t.dtype}. "
                f"Convert explicitly, e.g. {n}.float()."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v: expected one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}. "
            "attnkit never casts silently; convert them to one dtype first."
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v: expected one device, got q on {q.device}, k on {k.device}, v on {v.device}. "
            "Move them with .to(device)."
        )
    ranks = (q.dim(), k.dim(), v.dim())
    if q.dim() not in (2, 3, 4):
        raise ValueError(
            f"q: expected rank 2 (L, D), 3 (H, L, D) or 4 (B, H, L, D), got rank {q.dim()} with shape "
            f"{tuple(q.shape)}. Reshape to (B, H, L, D)."
        )
    if len(set(ranks)) > 1:
        raise ValueError(
            f"q, k, v: expected the same rank, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}. "
            f"For rank {q.dim()} all three are {_RANK_NAMES[q.dim()]}-shaped."
        )
    rank = q.dim()
    q4, k4, v4 = (_lift(t, rank) for t in (q, k, v))
    B, H, L, D = q4.shape
    Bk, Hkv, S, Dk = k4.shape
    Bv, Hv, Sv, Dv = v4.shape
    if Bk != B or Bv != B:
        raise ValueError(
            f"batch: expected q, k, v to share B, got q B={B}, k B={Bk}, v B={Bv}. "
            "attnkit does not broadcast the batch; expand it explicitly if that is what you want."
        )
    if Dk != D:
        raise ValueError(
            f"k: expected head dim D={D} (that of q), got {Dk} (k shape {tuple(k.shape)}). "
            "q and k must have the same last dimension."
        )
    if Sv != S:
        raise ValueError(
            f"v: expected S={S} keys/values (that of k), got {Sv} (v shape {tuple(v.shape)}). "
            "k and v must have the same sequence length."
        )
    if Hv != Hkv:
        raise ValueError(f"v: expected {Hkv} heads (that of k), got {Hv}.")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"k: expected a number of key/value heads Hkv that divides H={H}, got Hkv={Hkv}. "
            "For GQA/MQA use Hkv in the divisors of H (query head h uses kv head h // (H // Hkv))."
        )
    if D == 0:  # (S = 0 is a call: every row sees no key, output 0 and lse -inf as any fully masked row)
        raise ValueError(f"q: expected a head dimension D >= 1 (the scores are q · k over D; the default scale "
                         f"1/sqrt(D) divides by it), got D={D}.")
    return q4, k4, v4, rank, numpy_in


def _check_tensor_mask(mask, q: torch.Tensor, B, H, L, S):
    name = "mask"
    m = _to_torch(name, mask)
    _check_dense(name, m)
    if m.device != q.device:
        raise ValueError(f"mask: expected device {q.device} (that of q), got {m.device}. Move it with .to().")
    if m.dtype == torch.bool:
        is_bias = False
    elif m.dtype in _FLOATS:
        is_bias = True
        ok = (q.dtype,) if q.dtype in (torch.float32, torch.float64) else (q.dtype, torch.float32)
        if m.dtype not in ok:
            raise TypeError(
                f"mask: a float mask is an additive bias and must have dtype {' or '.join(map(str, ok))} "
                f"(that of q), got {m.dtype}. Convert it explicitly."
            )
    else:
        raise TypeError(_int_mask_message(m.dtype))
    if m.dim() > 4:
        raise ValueError(f"mask: expected at most 4 dims broadcastable to (B, H, L, S), got shape {tuple(m.shape)}.")
    m4 = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
    target = (B, H, L, S)
    for dim, (got, want) in enumerate(zip(m4.shape, target, strict=True)):
        if got not in (1, want):
            expected = "1" if want == 1 else f"1 or {want}"
            raise ValueError(
                f"mask: shape {tuple(m.shape)} is not broadcastable to (B, H, L, S) = {target} "
                f"(dim {'BHLS'[dim]} is {got}, expected {expected}). attnkit never truncates a mask; "
                "pass one whose trailing dims are (L, S)."
            )
    return m4, is_bias


def check_score_mod(score_mod, L: int, S: int) -> None:
    """Refuse a ``score_mod`` that is not a callable of FlexAttention's five arguments, naming the fix."""
    if not callable(score_mod):
        raise TypeError(f"score_mod: expected a callable (score, b, h, q_idx, kv_idx) -> score, "
                        f"got {type(score_mod).__name__}.")
    n = _mods.positional_arity(score_mod)  # FlexAttention's count: defaults do not count
    if n is not None and n != 5:
        raise TypeError(
            f"score_mod: expected a function of 5 arguments (score, b, h, q_idx, kv_idx), got one of {n} "
            "(parameters with a default value are not counted). "
            + (_mods.uncalled(score_mod) or "A 4-argument function is a mask_mod: pass it as mask= (to "
               f"flex_attention: block_mask=create_block_mask(mask_mod, B, H, {L}, {S})).")
        )


def make_request(
    q, k, v, *, mask, causal, scale, score_mod, dropout_p, return_lse, backend, return_weights=False, sinks=None
) -> Request:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(
            f"backend: expected one of {BACKENDS}, got {backend!r}. Use 'auto' to let attnkit choose "
            "(attnkit.dispatch(...) tells which backend runs and why)."
        )
    q4, k4, v4, rank, numpy_in = _check_qkv(q, k, v)
    B, H, L, D = q4.shape
    S = k4.shape[2]

    scale = 1.0 / math.sqrt(D) if scale is None else _scale_value(scale)
    if abs(scale) > _F32_MAX and q4.dtype != torch.float64:
        raise ValueError(f"scale: {scale!r} is past float32's range ({_F32_MAX:.4g}), where {q4.dtype} inputs are "
                         "scored (it would be inf: every output NaN). Pass a smaller scale, or float64 inputs.")

    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}.")

    if score_mod is not None:
        check_score_mod(score_mod, L, S)
        if isinstance(score_mod, _score_mods.ScoreMod):
            score_mod.validate(B, H, L, S)

    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected True or False, got {causal!r}. "
                        "For top-left alignment pass mask=attnkit.masks.causal('top_left').")

    req = Request(q=q4, k=k4, v=v4, scale=scale, score_mod=score_mod, dropout_p=float(dropout_p),
                  need_lse=bool(return_lse), return_lse=bool(return_lse), input_rank=rank, numpy_in=numpy_in)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected True or False, got {return_lse!r}.")
    req.weight_heads = _check_weight_heads(return_weights, H)
    req.sinks = None if sinks is None else _check_sinks(sinks, q4, B, H, L)
    if req.weight_heads is not None or req.sinks is not None:
        req.need_lse = True

    if is_block_mask(mask):  # FlexAttention's BlockMask: its blocks and mask_mod, as an explicit plan
        mask = block_mask_plan(mask, B, H, L, S, q4.device, "mask")
    structured: list[_masks.Mask] = []
    if causal:
        structured.append(_CAUSAL)
    if mask is None:
        pass
    elif isinstance(mask, _masks.Mask):
        if not isinstance(mask, _masks.Full):
            structured.append(mask)
    elif isinstance(mask, _plans.BlockPlan):
        mask.check(B, H, L, S)
        req.plan = mask
        req.plan_extra = structured[0] if structured else None  # causal=True on top of the plan
        structured.append(mask.mask)
    elif isinstance(mask, (torch.Tensor, np.ndarray)):
        m4, is_bias = _check_tensor_mask(mask, q4, B, H, L, S)
        if is_bias:
            req.bias = m4
        else:
            req.dense_mask = m4
    elif callable(mask):
        structured.append(_masks.from_mod(mask))
    else:
        raise TypeError(
            f"mask: expected None, a bool/float array or tensor, an attnkit.masks mask, an attnkit.plan(...), "
            f"FlexAttention's BlockMask, or a mask_mod(b, h, q_idx, kv_idx) callable, got {type(mask).__name__}."
        )
    if req.plan is None:  # an explicit plan is used as given
        structured = [m for m in (_simplify(m, L, S) for m in structured) if m is not None]
    if len(structured) == 1:
        req.mask = structured[0]
    elif len(structured) > 1:
        req.mask = _masks.And(*structured)
    if req.mask is not None:
        req.mask.validate(B, H, L, S)
    if isinstance(req.mask, _masks.Causal):
        req.causal, req.causal_align = True, req.mask.align
    if score_mod is not None and torch.is_grad_enabled():
        _find_score_mod_tensors(req)
    return req


_CAUSAL = _masks.causal()  # an immutable value: one object, so its tile maps are cached once


def _simplify(m: _masks.Mask, L: int, S: int) -> _masks.Mask | None:
    """The same mask in a cheaper form for these sizes (None: it lets every key through).

    A bottom-right causal mask with L = 1 is no mask (the one query sees the whole cache,
    the decoding step); a sliding window at least as wide as every query's visible prefix
    is plain causal::

        L = 1, S = 4:  causal  k0 k1 k2 k3   = no mask
                          q0    #  #  #  #
    """
    if isinstance(m, _masks.Causal):
        return None if (m.align == "bottom_right" and L == 1) or (m.align == "top_left" and S == 1) else m
    if isinstance(m, _masks.SlidingWindow):
        widest = L + S if m.align == "top_left" else S  # keys a query can see at most
        if m.size >= widest:
            return _simplify(_masks.causal(m.align), L, S)
    if type(m) is _masks.And:  # each part on its own (a decoding step's causal & padding is padding)
        parts = [p for p in (_simplify(x, L, S) for x in m.parts) if p is not None]
        if len(parts) < len(m.parts):
            return None if not parts else parts[0] if len(parts) == 1 else _masks.And(*parts)
    return m


def _check_weight_heads(return_weights, H: int):
    if return_weights is False or return_weights is None:
        return None
    if return_weights is True:
        return list(range(H))
    try:  # integers only (ints, NumPy integers, 0-d integer tensors): int(0.7) would quietly pick head 0
        heads = [operator.index(h) for h in return_weights]
    except (TypeError, ValueError):
        heads = None
    if (heads is None or isinstance(return_weights, (str, bytes)) or not heads
            or any(isinstance(h, bool) for h in return_weights)):
        raise TypeError(
            "return_weights: expected True, False or a non-empty sequence of query-head indices, "
            f"got {return_weights!r}.")
    bad = [h for h in heads if not 0 <= h < H]
    if bad:
        raise ValueError(f"return_weights: head indices must be in [0, {H}) (H={H}), got {bad}. Pass heads 0..{H - 1}.")
    return heads


def _check_sinks(sinks, q: torch.Tensor, B: int, H: int, L: int) -> torch.Tensor:
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks: expected a float torch.Tensor of shape (H,) = ({H},), got {type(sinks).__name__}.")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks: expected a floating dtype, got {sinks.dtype}. Convert it with sinks.float().")
    if sinks.device != q.device:
        raise ValueError(f"sinks: expected device {q.device} (that of q), got {sinks.device}. Move it with .to().")
    if sinks.dim() == 1:
        if sinks.shape[0] != H:
            raise ValueError(f"sinks: expected one logit per query head, shape ({H},), got {tuple(sinks.shape)}.")
        return sinks.view(1, H, 1)
    if sinks.dim() != 3 or any(g not in (1, w) for g, w in zip(sinks.shape, (B, H, L), strict=True)):
        raise ValueError(
            f"sinks: expected shape (H,) or a 3-D tensor broadcastable to (B, H, L) = {(B, H, L)}, got "
            f"{tuple(sinks.shape)}.")
    return sinks


def _find_score_mod_tensors(req: Request) -> None:
    fn = req.score_mod
    if isinstance(fn, _score_mods.ScoreMod):
        req.grad_tensors = [t for t in fn.tensors() if t.requires_grad]
        return
    req.grad_tensors = _mods.captured_grad_tensors(fn)
    B, H, L, S = req.q.shape[0], req.q.shape[1], req.q.shape[2], req.k.shape[2]
    # (no score at all — L, S or B of 0 — calls the mod at no point: the probe's point (0, 0, 0, 0) is not one)
    req.grad_hidden = B * H * L * S > 0 and _mods.reads_uncaptured_grad(fn, req.grad_tensors, (B, H, L, S),
                                                                      req.compute_dtype())
