"""The one validation point: public arguments in, a normalised ``Request`` out.

Every backend receives a ``Request`` whose tensors are already 4-D torch
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
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from . import _mods
from . import masks as _masks
from . import score_mods as _score_mods

__all__ = ["Request", "make_request", "BACKENDS"]

BACKENDS = ("auto", "reference", "eager", "sdpa", "tiled")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class Request:
    q: torch.Tensor  # (B, H, L, D)
    k: torch.Tensor  # (B, Hkv, S, D)
    v: torch.Tensor  # (B, Hkv, S, Dv)
    scale: float
    mask: _masks.Mask | None = None
    dense_mask: torch.Tensor | None = None  # bool, 4-D, broadcastable to (B, H, L, S)
    bias: torch.Tensor | None = None  # float, 4-D, broadcastable to (B, H, L, S)
    score_mod: Callable | None = None
    dropout_p: float = 0.0
    causal: bool = False  # True when ``mask`` is exactly one causal mask (SDPA's is_causal)
    causal_align: str = "bottom_right"
    need_lse: bool = False
    # Tensors the score_mod reads that require grad (its own for attnkit's ScoreMods; found in
    # the closure, defaults and globals of any other function). Backends that accept a call
    # return gradients into them; ``grad_hidden`` says the mod reads a tensor requiring grad
    # that attnkit could not find, which only a backend differentiating through the whole
    # computation (eager) can honour.
    grad_tensors: list = field(default_factory=list)
    grad_hidden: bool = False
    # bookkeeping for the public boundary
    input_rank: int = 4
    numpy_in: bool = False
    # Per-call memo (e.g. the tile summary of a user bool mask, shared by auto's look at it
    # and the tiled run). It lives and dies with this request, so it can never be stale.
    memo: dict = field(default_factory=dict)

    @property
    def shape(self):
        B, H, L, D = self.q.shape
        return B, H, L, self.k.shape[2], D, self.v.shape[3], self.k.shape[1]

    @property
    def has_mask(self) -> bool:
        return self.mask is not None or self.dense_mask is not None or self.bias is not None

    def requires_grad(self) -> bool:
        """Whether any gradient is wanted: of q, k, v, a float mask, or a tensor the score_mod reads."""
        if not torch.is_grad_enabled():
            return False
        return (any(t.requires_grad for t in (self.q, self.k, self.v))
                or (self.bias is not None and self.bias.requires_grad)
                or bool(self.grad_tensors) or self.grad_hidden)

    def extra_grads(self) -> bool:
        """Whether gradients are wanted beyond q, k, v (into a float mask or score_mod tensors)."""
        return torch.is_grad_enabled() and ((self.bias is not None and self.bias.requires_grad)
                                            or bool(self.grad_tensors) or self.grad_hidden)

    def compute_dtype(self) -> torch.dtype:
        """fp32/fp64 compute in their own dtype; bf16/fp16 keep scores and statistics in fp32."""
        return self.q.dtype if self.q.dtype in (torch.float32, torch.float64) else torch.float32


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
        if x.dtype.kind == "f" and x.dtype.itemsize in (2, 4, 8):
            return torch.from_numpy(np.ascontiguousarray(x))
        if x.dtype == np.bool_:
            return torch.from_numpy(np.ascontiguousarray(x))
        if name == "mask":
            raise TypeError(_int_mask_message(x.dtype))
        raise TypeError(
            f"{name}: expected a floating-point array (float16/32/64), got dtype {x.dtype}. "
            f"Convert explicitly, e.g. {name}.astype(np.float32)."
        )
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}.")


def _int_mask_message(dtype) -> str:
    # A 0/1 integer mask means keep/drop; turning it into floats would make it a bias of
    # 0 and 1 (everything attended), so the fix offered is the bool conversion.
    return (
        f"mask: expected a bool mask (True = attend) or a float additive bias, got integer dtype {dtype}. "
        "If it holds 1 = attend / 0 = masked, convert it with mask.astype(bool) (NumPy) or mask.bool() "
        "(torch); if it is an additive bias, convert it to q's float dtype. attnkit does not guess which."
    )


def _lift(name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
    if rank == 2:
        return t.unsqueeze(0).unsqueeze(0)
    if rank == 3:
        return t.unsqueeze(0)
    return t


_RANK_NAMES = {2: "(L, D)", 3: "(H, L, D)", 4: "(B, H, L, D)"}


def _check_qkv(q, k, v):
    kinds = {_kind(q), _kind(k), _kind(v)}
    if not kinds <= {"torch", "numpy"}:
        bad = [n for n, x in (("q", q), ("k", k), ("v", v)) if _kind(x) not in ("torch", "numpy")][0]
        x = {"q": q, "k": k, "v": v}[bad]
        raise TypeError(f"{bad}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}.")
    if len(kinds) > 1:
        raise TypeError(
            f"q, k, v: expected all torch tensors or all NumPy arrays, got q={_kind(q)}, k={_kind(k)}, "
            f"v={_kind(v)}. Convert them to one kind (torch.from_numpy or tensor.numpy())."
        )
    numpy_in = kinds == {"numpy"}
    q, k, v = (_to_torch(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
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
    q4, k4, v4 = (_lift(n, t, rank) for n, t in (("q", q), ("k", k), ("v", v)))
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
    if S == 0 or D == 0:
        raise ValueError(f"k: expected at least one key (S >= 1) and D >= 1, got S={S}, D={D}.")
    return q4, k4, v4, rank, numpy_in


def _check_tensor_mask(mask, q: torch.Tensor, rank: int, B, H, L, S):
    name = "mask"
    m = _to_torch(name, mask)
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
    for dim, (got, want) in enumerate(zip(m4.shape, target)):
        if got not in (1, want):
            raise ValueError(
                f"mask: shape {tuple(m.shape)} is not broadcastable to (B, H, L, S) = {target} "
                f"(dim {'BHLS'[dim]} is {got}, expected 1 or {want}). attnkit never truncates a mask; "
                "pass one whose trailing dims are (L, S)."
            )
    return m4, is_bias


def make_request(
    q, k, v, *, mask, causal, scale, score_mod, dropout_p, return_lse, backend
) -> Request:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(
            f"backend: expected one of {BACKENDS}, got {backend!r}. Use 'auto' to let attnkit choose "
            "(attnkit.dispatch(...) tells which backend runs and why)."
        )
    q4, k4, v4, rank, numpy_in = _check_qkv(q, k, v)
    B, H, L, D = q4.shape
    S = k4.shape[2]

    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale: expected a finite float (default 1/sqrt(D)), got {scale!r}.")
    scale = float(scale)

    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}.")

    if score_mod is not None:
        if not callable(score_mod):
            raise TypeError(f"score_mod: expected a callable (score, b, h, q_idx, kv_idx) -> score, got {type(score_mod).__name__}.")
        n = _mods.positional_arity(score_mod)  # FlexAttention's count: defaults do not count
        if n is not None and n != 5:
            raise TypeError(
                f"score_mod: expected a function of 5 arguments (score, b, h, q_idx, kv_idx), got one of {n} "
                "(parameters with a default value are not counted). "
                "A 4-argument function is a mask_mod: pass it as mask=."
            )
        if isinstance(score_mod, _score_mods.ScoreMod):
            score_mod.validate(B, H, L, S)

    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected True or False, got {causal!r}. For top-left alignment pass mask=attnkit.masks.causal('top_left').")

    req = Request(q=q4, k=k4, v=v4, scale=scale, score_mod=score_mod, dropout_p=float(dropout_p),
                  need_lse=bool(return_lse), input_rank=rank, numpy_in=numpy_in)

    structured: list[_masks.Mask] = []
    if causal:
        structured.append(_masks.causal())
    if mask is None:
        pass
    elif isinstance(mask, _masks.Mask):
        if not isinstance(mask, _masks.Full):
            structured.append(mask)
    elif isinstance(mask, (torch.Tensor, np.ndarray)):
        m4, is_bias = _check_tensor_mask(mask, q4, rank, B, H, L, S)
        if is_bias:
            req.bias = m4
        else:
            req.dense_mask = m4
    elif callable(mask):
        structured.append(_masks.from_mod(mask))
    else:
        raise TypeError(
            f"mask: expected None, a bool/float array or tensor, an attnkit.masks mask, or a "
            f"mask_mod(b, h, q_idx, kv_idx) callable, got {type(mask).__name__}."
        )
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


def _find_score_mod_tensors(req: Request) -> None:
    fn = req.score_mod
    if isinstance(fn, _score_mods.ScoreMod):
        req.grad_tensors = [t for t in fn.tensors() if t.requires_grad]
        return
    req.grad_tensors = _mods.captured_grad_tensors(fn)
    B, H, L, S = req.q.shape[0], req.q.shape[1], req.q.shape[2], req.k.shape[2]
    req.grad_hidden = _mods.reads_uncaptured_grad(fn, req.grad_tensors, (B, H, L, S), req.compute_dtype())
