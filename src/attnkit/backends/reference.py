"""``backend="reference"``: the textbook formula in NumPy float64, one literal step
at a time, with every intermediate kept (see :class:`Trace`).

    scores  = Q Kᵀ                         (B, H, L, S)
    scaled  = scores · scale               scale = 1/√D unless given
    masked  = scaled → score_mod → + bias → rounded to fp32 for an fp32/bf16/fp16 call
              → -inf where the mask forbids
    weights = softmax(masked) per row       (rows sum to 1; a fully masked row is 0)
    output  = weights V                     (B, H, L, Dv)
    lse     = log Σ_j exp(masked)           (B, H, L); -inf on a fully masked row

No tiling, no online softmax, no cleverness: this is the golden every other
backend is tested against. Masks and score_mods are evaluated with torch index
tensors (their signatures are FlexAttention's), everything else is NumPy.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch

from .._tiling import host_array
from ._base import Request
from ._kernel import Kernel
from ._tiles import apply_score_mod, index_grid

__all__ = ["NAME", "REFERENCE", "unsupported", "run", "trace", "Trace", "ScoreOverflowWarning", "overflowed"]

NAME = "reference"


@dataclass
class Trace:
    """Every step of one attention computation, as float64 NumPy arrays.

    Shapes follow the input rank (as :func:`attnkit.attention`'s output does). For
    4-D inputs q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv): ``scores``,
    ``scaled``, ``masked``, ``weights`` and ``allowed`` (the bool mask, True = attend)
    are ``(B, H, L, S)``; ``output`` ``(B, H, L, Dv)``; ``lse`` ``(B, H, L)``; ``q``
    ``(B, H, L, D)`` and ``k``/``v`` repeated to the H query heads. For (H, L, D)
    inputs the leading B is dropped, for (L, D) inputs both B and H: scores ``(L, S)``,
    output ``(L, Dv)``, lse ``(L,)``. (:func:`trace` itself works at rank 4;
    :func:`attnkit.explain` returns ``trace(req).at_rank(input rank)``.)
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float
    scores: np.ndarray
    scaled: np.ndarray
    masked: np.ndarray
    allowed: np.ndarray
    weights: np.ndarray
    output: np.ndarray
    lse: np.ndarray
    has_mask: bool = False

    def __str__(self) -> str:
        from .._format import format_trace

        return format_trace(self)

    def __repr__(self) -> str:
        from .._format import trace_repr

        return trace_repr(self)

    def _repr_html_(self) -> str | None:
        from .._display import html

        return html("trace", self)

    def at_rank(self, rank: int) -> Trace:
        """This rank-4 trace with the leading (B, H) dims dropped to match a rank-2 or rank-3 input."""
        if rank == 4:
            return self
        if rank not in (2, 3) or self.scores.ndim != 4 or self.scores.shape[0] != 1 or (
                rank == 2 and self.scores.shape[1] != 1):
            raise ValueError(f"rank: expected 2, 3 or 4 for a trace of scores {self.scores.shape}, got {rank}.")
        idx = (0, 0) if rank == 2 else (0,)
        arrays = {f: getattr(self, f)[idx] for f in
                  ("q", "k", "v", "scores", "scaled", "masked", "allowed", "weights", "output", "lse")}
        return replace(self, **arrays)


def unsupported(req: Request) -> str | None:
    if req.dropout_p > 0:
        return "the reference is deterministic and has no dropout (use backend='eager')"
    if req.requires_grad():
        return "the reference is NumPy and has no autograd (use backend='eager' or 'tiled')"
    return None


def trace(req: Request) -> Trace:
    B, H, L, S, D, Dv, Hkv = req.shape
    g = H // Hkv
    q = host_array(req.q.cpu().to(torch.float64))  # (read without .numpy(): the user's tensors stay resizable)
    # The reference may copy: repeat each kv head for its g query heads.
    k = np.repeat(host_array(req.k.cpu().to(torch.float64)), g, axis=1)
    v = np.repeat(host_array(req.v.cpu().to(torch.float64)), g, axis=1)

    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is said once, by name, below
        scores = q @ np.swapaxes(k, -1, -2)  # (B, H, L, S)
        scaled = scores * req.scale
    _warn_overflow(q, k, scaled, req.compute_dtype())
    masked = scaled.copy()
    if req.score_mod is not None:
        b, h, qi, kv = index_grid(B, H, 0, L, 0, S, "cpu")
        masked = host_array(apply_score_mod(req, torch.from_numpy(masked), b, h, qi, kv).to(torch.float64))
        masked = np.broadcast_to(masked, (B, H, L, S)).copy()
    # (a score past the dtype's range, e.g. float64's finfo.min added to a negative one, is -inf as IEEE rounds it
    # in every backend: not a warning for the caller)
    with np.errstate(over="ignore"):
        if req.bias is not None:
            masked = masked + host_array(req.bias.cpu().to(torch.float64))
        if req.compute_dtype() == torch.float32:
            # The scores every backend computes for an fp32 (or bf16/fp16) call are fp32 numbers; on a
            # row at finfo.min or -1e9 fp32 keeps no trace of q·k (finfo.min + q·k == finfo.min), so
            # the row's softmax is 1/S. Rounded here too, the reference computes that same function
            # exactly, instead of a float64 one no fp32 computation can match.
            masked = masked.astype(np.float32).astype(np.float64)
    allowed = np.ones((B, H, L, S), dtype=bool)
    if req.mask is not None:
        allowed &= req.mask.materialize(B, H, L, S).cpu().numpy()
    if req.dense_mask is not None:
        allowed &= np.broadcast_to(host_array(req.dense_mask.cpu()), (B, H, L, S))
    masked = np.where(allowed, masked, -np.inf)

    # Stable softmax: subtract the row max (0 for a row that sees no key). A row whose scores hold NaN, or +inf
    # (inf - inf), has a NaN sum: its weights and lse are NaN throughout, as torch.softmax's.
    m = masked.max(axis=-1, keepdims=True, initial=-np.inf)  # (S = 0: no key, the row max -inf)
    m = np.where(np.isneginf(m), 0.0, m)
    with np.errstate(invalid="ignore"):
        e = np.exp(masked - m)
    denom = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = (m + np.log(denom))[..., 0]
        weights = e / np.where(denom == 0, 1.0, denom)
    output = weights @ np.where(np.isfinite(v), v, 0.0)
    # A NaN or inf in V reaches the rows that see its key (0 · NaN = NaN where a seen key's weight underflowed), and
    # never a row the mask hides the key from: those entries added key by key, only where the key is allowed.
    for b_, h_, j in zip(*np.nonzero(~np.isfinite(v).all(axis=-1)), strict=True):
        seen = allowed[b_, h_, :, j]
        with np.errstate(invalid="ignore"):
            output[b_, h_, seen] += np.where(np.isfinite(v[b_, h_, j]), 0.0, weights[b_, h_, seen, j][:, None]
                                             * v[b_, h_, j])
    return Trace(q=q, k=k, v=v, scale=req.scale, scores=scores, scaled=scaled, masked=masked,
                 allowed=allowed, weights=weights, output=output, lse=lse, has_mask=req.has_mask)


class ScoreOverflowWarning(RuntimeWarning):
    """Finite q and k gave a scaled score past the call's dtype's range (±inf; a row holding +inf is NaN)."""


def overflowed(q: np.ndarray, k: np.ndarray, scaled: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Bool, ``scaled``'s shape: where finite rows of ``q`` and ``k`` (``(..., L, D)``, ``(..., S, D)``) gave a
    scaled score past ``dtype``'s range (or NaN, 0 · inf). The caller's own inf / NaN is not an overflow."""
    big = float(torch.finfo(dtype).max)
    with np.errstate(invalid="ignore"):
        out = ~(np.abs(scaled) <= big)
    if out.any():
        out &= np.isfinite(q).all(axis=-1)[..., :, None] & np.isfinite(k).all(axis=-1)[..., None, :]
    return out


def _warn_overflow(q: np.ndarray, k: np.ndarray, scaled: np.ndarray, dtype: torch.dtype) -> None:
    """Warn, once per call, where finite q and k give a scaled score past the call's dtype's range.

    Such a score is ±inf in every backend (torch's too), and a row holding +inf has NaN weights and output
    (inf - inf): an honest IEEE answer, but not one a caller should meet unannounced.
    """
    out = overflowed(q, k, scaled, dtype)
    if not out.any():
        return
    b, h, i, j = (int(x[0]) for x in np.nonzero(out))
    name = str(dtype).replace("torch.", "")
    warnings.warn(f"q·kᵀ · scale overflows {name} (|score| > {torch.finfo(dtype).max:.3g}) in {int(out.sum())} "
                  f"score(s), first at batch {b}, head {h}, query {i}, key {j}: those scores are ±inf, and a row "
                  f"holding +inf has NaN weights and output (inf - inf), as in torch. Inputs this large are usually "
                  f"a bug upstream; scale q or k down (or pass a smaller scale=) to get finite scores.",
                  ScoreOverflowWarning, stacklevel=4)


class Reference(Kernel):
    """The textbook steps in NumPy float64 (named only: ``backend="reference"``)."""

    name = "reference"
    backend = "reference"
    worker = "numpy"
    title = "the NumPy float64 reference"

    def not_supported(self, req: Request) -> list[str]:
        return [w for w in (unsupported(req),) if w is not None]

    def why(self, req: Request) -> str:
        return "the textbook steps in NumPy float64"

    def run(self, req: Request):
        return run(req)


REFERENCE = Reference()


def run(req: Request, worker: str | None = None):
    t = trace(req)
    dt = req.q.dtype
    out = torch.from_numpy(t.output).to(device=req.q.device, dtype=dt)
    lse_dt = dt if dt in (torch.float32, torch.float64) else torch.float32
    lse = torch.from_numpy(t.lse).to(device=req.q.device, dtype=lse_dt)
    return out, lse
