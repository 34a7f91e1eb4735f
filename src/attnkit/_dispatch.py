"""One dispatch decision per call, explainable: which backend runs and why.

``attnkit.dispatch(q, k, v, **options)`` returns the :class:`Decision` that
``attention`` would take, without running anything. The same decision is logged
on the ``attnkit`` logger at DEBUG level on every call.

``auto`` on the CPU, from measurements (``attnkit bench``; BENCHMARKS.md):

====================================================  ========  ==========================================
request                                               backend   why
====================================================  ========  ==========================================
dropout_p > 0                                         eager     the only path with dropout
no mask; causal top-left or L == S; no score_mod      sdpa      torch's fused kernel: no plan, no mask
same, at L·S >= 1024² (none) or L >= 256 (causal)    tiled     attnkit's compiled kernel is faster there
float bias only (no bool mask)                        sdpa      nothing to skip: one fused pass
float bias, or fp16 on the CPU, gradients wanted     tiled     SDPA's backward is inexact there (issue 18)
user bool mask with empty/full tiles                  tiled     skips empty tiles, no mask on full ones
user bool mask, every tile partial                    sdpa      nothing to skip (tiled ≈ 0.96× there)
structured mask, bottom-right causal L ≠ S, score_mod tiled     SDPA would need a dense (L, S) mask
====================================================  ========  ==========================================

The bool-mask rule: with a 4096² mask, one thread, tiled beat SDPA-with-mask by
1.6-4.5× on banded/causal masks given densely, and was 0.96× on a random mask
whose tiles are all partial; so ``auto`` reduces the mask per tile (one pass over
a tensor the user already built) and sends it to ``tiled`` unless more than
``DENSE_PARTIAL_MAX`` of the tiles are partial.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .backends import get
from .backends._base import Request

# Above this fraction of partial tiles a user bool mask goes to SDPA (see the table above).
DENSE_PARTIAL_MAX = 0.9
# Where attnkit's compiled kernel beats torch SDPA on SDPA's own ground (benchmarks/auto_grid.py, 2 threads,
# fp32, D = 64): causal from L = 256 (1.17-1.41x, forward and forward+backward; at L = 64 SDPA's lower
# per-call cost wins), no mask from L·S = 1024² (forward 1.03-1.04x, forward+backward 1.12x).
NATIVE_CAUSAL_MIN = 256
NATIVE_DENSE_MIN_LS = 1024 * 1024

__all__ = ["Decision", "decide"]

log = logging.getLogger("attnkit")


@dataclass(frozen=True)
class Decision:
    """Which backend runs, which of its workers, and why (both choices explained).

    ``worker`` is ``"native"`` (attnkit's compiled CPU kernel), ``"fused"`` or ``"plain"`` for
    ``tiled`` (torch's private CPU flash kernel per run, or plain torch ops), ``"fused"`` or
    ``"math"`` for ``sdpa``, and the backend's only worker otherwise.

    ``deterministic``: whether forward and backward give the same bits on every run with the same
    inputs and thread count. True for every CPU path (the compiled kernel adds dQ in key-tile order;
    torch's CPU kernels reduce in a fixed order), so ``torch.use_deterministic_algorithms(True)``
    changes nothing there; None on a GPU, where torch's own kernels decide (and raise under that
    switch where they are not).
    """

    backend: str
    reason: str
    worker: str = ""
    worker_reason: str = ""
    deterministic: bool | None = True

    def __str__(self) -> str:
        w = f" [{self.worker}: {self.worker_reason}]" if self.worker else ""
        return f"{self.backend}: {self.reason}{w}"

    def _repr_html_(self) -> str | None:
        from ._display import html

        return html("decision", self)


def _sdpa_fits(req: Request) -> str | None:
    """Why auto should not use SDPA for this request (None: SDPA is the right choice)."""
    L, S = req.q.shape[2], req.k.shape[2]
    if req.score_mod is not None:
        return "a score_mod"
    flaw = get("sdpa").backward_flaw(req)
    if flaw is not None and req.dropout_p == 0:
        # SDPA's own autograd would be inexact (issue 18); sdpa itself would hand this call to
        # the tiled engine anyway (sdpa.choose_worker)
        return flaw
    if req.mask is None and req.dense_mask is None:
        if req.bias is None and L * S >= NATIVE_DENSE_MIN_LS and _native_fits(req):
            return "no mask at L·S >= 1024²: attnkit's compiled kernel is faster than SDPA here"
        return None  # no mask, or only a float bias: nothing to skip, SDPA applies it in one fused pass
    if L <= get("sdpa").DECODE_MAX_L and req.plan is None:
        return None  # decoding: SDPA over the keys the mask can reach, with an (L × n) mask built per call
    if req.dense_mask is not None and req.mask is None:
        partial = _dense_partial_fraction(req)
        if partial > DENSE_PARTIAL_MAX:
            return None
        return f"a bool mask with {100 * (1 - partial):.0f}% of its tiles empty or full"
    if req.causal and (req.causal_align == "top_left" or L == S):
        if req.bias is None and req.dense_mask is None:
            if min(L, S) >= NATIVE_CAUSAL_MIN and _native_fits(req):
                return f"causal at L >= {NATIVE_CAUSAL_MIN}: attnkit's compiled kernel is faster than SDPA's is_causal"
            return None
        return "causal with a tensor mask (SDPA would merge them into a dense (B, H, L, S) mask)"
    return f"mask {req.mask!r} (SDPA would need a dense (B, H, L, S) mask)"


def _native_fits(req: Request) -> bool:
    """Whether the tiled backend would run this call on attnkit's compiled kernel."""
    return req.q.device.type == "cpu" and get("tiled").native_unfit(req) is None


def decide(req: Request, backend: str) -> Decision:
    """The backend and worker for ``req``: the backend by the table above, then the
    backend's own choice of worker (``choose_worker``), both with their reasons."""
    d = _decide_backend(req, backend)
    worker, why = get(d.backend).choose_worker(req)
    return Decision(d.backend, d.reason, worker, why, None if req.q.device.type == "cuda" else True)


def _decide_backend(req: Request, backend: str) -> Decision:
    if backend != "auto":
        why = get(backend).unsupported(req)
        if why is not None:
            raise ValueError(f"backend={backend!r} cannot honour this call: {why}.")
        return Decision(backend, "asked for by name")
    return auto_backend(req, req.q.device.type)


def auto_backend(req: Request, device_type: str) -> Decision:
    """``auto``'s choice for ``req`` on a device of this type (a parameter so the GPU table
    can be exercised on a machine without one)."""
    if req.dropout_p > 0:
        return Decision("eager", "dropout_p > 0: only the eager path implements dropout")
    if device_type == "cuda":
        return _auto_cuda(req)
    tiled_why = _tiled_unsupported(req)
    sdpa_no = _sdpa_fits(req)
    if sdpa_no is None and get("sdpa").unsupported(req) is None:
        if req.q.shape[2] <= get("sdpa").DECODE_MAX_L and (req.mask is not None or req.dense_mask is not None):
            return Decision("sdpa", f"decode-sized L <= {get('sdpa').DECODE_MAX_L}: torch's fused kernel over the "
                                    "keys the mask can reach, with a small dense mask built per call")
        if req.dense_mask is not None:
            return Decision("sdpa", "bool mask with almost every tile partial: nothing to skip, "
                                    "torch's fused kernel applies it in one pass")
        if req.bias is not None:
            return Decision("sdpa", "float bias and nothing to skip: torch's fused kernel applies it in one pass")
        kind = "causal" if req.causal else "dense"
        return Decision("sdpa", f"{kind} attention without score_mod: torch's fused kernel is fastest here")
    if tiled_why is None:
        if sdpa_no and get("sdpa").backward_flaw(req) == sdpa_no:
            reason = f"tiled kernel, exact gradients where SDPA's are not: {sdpa_no}"
        else:
            reason = (sdpa_no if sdpa_no and "compiled kernel is faster" in sdpa_no
                      else f"block-sparse tiled kernel for {sdpa_no}" if sdpa_no
                      else "torch SDPA cannot return what was asked")
        return Decision("tiled", reason)
    return Decision("eager", f"tiled backend unavailable ({tiled_why}); eager math path")


def _auto_cuda(req: Request) -> Decision:
    """On a GPU the best kernels exist already: SDPA (FlashAttention / cuDNN / efficient, as
    torch chooses) for dense, causal and what it expresses without a dense mask; FlexAttention
    driven by attnkit's BlockMask for structured masks and score_mods; the tiled plain worker
    for anything neither honours."""
    L, S = req.q.shape[2], req.k.shape[2]
    sdpa_ok = get("sdpa").unsupported(req) is None
    plain = (req.score_mod is None and req.dense_mask is None and req.bias is None
             and (req.mask is None or (req.causal and (req.causal_align == "top_left" or L == S))))
    if plain and sdpa_ok:
        kind = "causal" if req.causal else "dense"
        return Decision("sdpa", f"{kind} attention on a GPU: torch SDPA's fused kernels (flash / cuDNN / efficient)")
    why_flex = get("flex").unsupported(req)
    if why_flex is None:
        what = ("a score_mod" if req.score_mod is not None
                else f"mask {req.mask!r}" if req.mask is not None else "a tensor mask")
        return Decision("flex", f"{what} on a GPU: FlexAttention's kernel with attnkit's BlockMask (no dense mask)")
    if (req.bias is not None or req.dense_mask is not None) and req.mask is None and req.score_mod is None and sdpa_ok:
        return Decision("sdpa", f"a tensor mask on a GPU, FlexAttention unavailable ({why_flex}): SDPA applies it")
    if get("tiled").unsupported(req) is None:
        return Decision("tiled",
                        f"FlexAttention cannot honour this ({why_flex}): the tiled plain worker runs on any device")
    return Decision("eager", f"neither FlexAttention ({why_flex}) nor tiled can honour this: eager math path")


def _dense_partial_fraction(req: Request) -> float:
    """Fraction of the tiled backend's tiles that a user bool mask leaves partial (asked of tiled)."""
    return get("tiled").partial_fraction(req)


def _tiled_unsupported(req: Request) -> str | None:
    return get("tiled").unsupported(req)


def explain_decision(req: Request, backend: str) -> Decision:
    d = decide(req, backend)
    log.debug("attnkit.attention -> %s", d)
    return d
