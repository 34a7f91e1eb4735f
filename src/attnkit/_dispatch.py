"""One dispatch decision per call, explainable: which backend runs and why.

``attnkit.dispatch(q, k, v, **options)`` returns the :class:`Decision` that
``attention`` would take, without running anything. The same decision is logged
on the ``attnkit`` logger at DEBUG level on every call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ._request import Request
from .backends import get

__all__ = ["Decision", "decide"]

log = logging.getLogger("attnkit")


@dataclass(frozen=True)
class Decision:
    backend: str
    reason: str

    def __str__(self) -> str:
        return f"{self.backend}: {self.reason}"


def _sdpa_fits(req: Request) -> str | None:
    """Why auto should not use SDPA for this request (None: SDPA is the right choice)."""
    L, S = req.q.shape[2], req.k.shape[2]
    if req.score_mod is not None:
        return "a score_mod"
    if req.dense_mask is not None or req.bias is not None:
        return None  # the user already built a dense mask: SDPA applies it in one fused pass
    if req.mask is None:
        return None
    if req.causal and (req.causal_align == "top_left" or L == S):
        return None
    return f"mask {req.mask!r} (SDPA would need a dense (B, H, L, S) mask)"


def decide(req: Request, backend: str) -> Decision:
    if backend != "auto":
        why = get(backend).unsupported(req)
        if why is not None:
            raise ValueError(f"backend={backend!r} cannot honour this call: {why}.")
        return Decision(backend, "asked for by name")
    if req.dropout_p > 0:
        return Decision("eager", "dropout_p > 0: only the eager path implements dropout")
    tiled_why = _tiled_unsupported(req)
    sdpa_no = _sdpa_fits(req)
    if sdpa_no is None and get("sdpa").unsupported(req) is None:
        if req.dense_mask is not None or req.bias is not None:
            return Decision("sdpa", "dense mask given: torch's fused kernel applies it in one pass")
        kind = "causal" if req.causal else "dense"
        return Decision("sdpa", f"{kind} attention without score_mod: torch's fused kernel is fastest here")
    if tiled_why is None:
        reason = f"block-sparse tiled kernel for {sdpa_no}" if sdpa_no else "torch SDPA cannot return what was asked"
        return Decision("tiled", reason)
    return Decision("eager", f"tiled backend unavailable ({tiled_why}); eager math path")


def _tiled_unsupported(req: Request) -> str | None:
    try:
        mod = get("tiled")
    except ImportError as e:  # during bring-up the tiled backend may not exist yet
        return f"not built: {e}"
    return mod.unsupported(req)


def explain_decision(req: Request, backend: str) -> Decision:
    d = decide(req, backend)
    log.debug("attnkit.attention -> %s", d)
    return d
