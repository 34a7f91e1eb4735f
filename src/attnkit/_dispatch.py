"""One dispatch decision per call, explainable: which kernel runs and why.

``attnkit.dispatch(q, k, v, **options)`` returns the :class:`Decision` that ``attention`` would take,
without running anything. The same decision is logged on the ``attnkit`` logger at DEBUG level on
every call.

Every compute path is a declared kernel (:mod:`attnkit.backends._kernel`) and one row of its device's
ordered table (:mod:`attnkit.backends._table`); this module walks the table and nothing else. ``auto``
on the CPU, from measurements (``attnkit bench``; BENCHMARKS.md; each kernel's ``measured``):

====================================================  ========  ==========================================
request                                               kernel    why
====================================================  ========  ==========================================
dropout_p > 0                                         eager     the only path with dropout under auto
no mask; causal top-left or L == S; no score_mod      sdpa      torch's fused kernel: no plan, no mask
same, at L·S >= 1024² (none) or L >= 64 (causal)     native    attnkit's compiled kernel is faster there
float bias only (no bool mask)                        sdpa      nothing to skip: one fused pass
float bias, or fp16 on the CPU, gradients wanted     tiled     SDPA's backward is inexact there (issue 18)
user bool mask, L and S <= 64 (one tile)            sdpa      no tile to skip
user bool mask with empty/full tiles                  tiled     skips empty tiles, no mask on full ones
user bool mask, every tile partial                    sdpa      nothing to skip (tiled ≈ 0.96× there)
structured mask, bottom-right causal L ≠ S, score_mod native    SDPA would need a dense (L, S) mask
====================================================  ========  ==========================================

The bool-mask rule: with a 4096² mask, one thread, tiled beat SDPA-with-mask by
1.6-4.5× on banded/causal masks given densely, and was 0.96× on a random mask
whose tiles are all partial; so ``auto`` reduces the mask per tile (one pass over
a tensor the user already built) and sends it to ``tiled`` unless more than
``tiled.DENSE_PARTIAL_MAX`` of the tiles are partial.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .backends import _table, get
from .backends._base import Request
from .backends._kernel import Kernel
from .backends.sdpa import NATIVE_CAUSAL_MIN, NATIVE_DENSE_MIN_LS
from .backends.tiled import DENSE_PARTIAL_MAX

__all__ = ["Decision", "decide"]
__all__ += ["DENSE_PARTIAL_MAX", "NATIVE_CAUSAL_MIN", "NATIVE_DENSE_MIN_LS"]  # the thresholds, where they live

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

    ``verdicts``: the device table's verdict on each kernel it may run, in order; ``table()`` prints them::

        > native-decode  runs                     a decode step: the first row that can and does not decline
          sdpa           not asked
          native         not asked
          ...

    ``kernel``: the declared kernel that runs (``kernel.run(request)``).
    """

    backend: str
    reason: str
    worker: str = ""
    worker_reason: str = ""
    deterministic: bool | None = True
    # the table's verdict on each kernel it may run, in order: (kernel, "runs" | "cannot: …" | "declines: …"
    # | "not asked")
    verdicts: tuple[tuple[str, str], ...] = ()
    kernel: Kernel | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        w = f" [{self.worker}: {self.worker_reason}]" if self.worker else ""
        return f"{self.backend}: {self.reason}{w}"

    def table(self) -> str:
        """The device table's verdicts, one kernel a line (the chosen one marked ``>``)."""
        width = max((len(n) for n, _ in self.verdicts), default=0)
        return "\n".join(f"{'>' if v == 'runs' else ' '} {n:<{width}}  {v}" for n, v in self.verdicts)

    def _repr_html_(self) -> str | None:
        from ._display import html

        return html("decision", self)


def decide(req: Request, backend: str) -> Decision:
    """The kernel for ``req``: the first row of its device's table that can run it and (for ``auto``)
    does not decline it; every row's verdict up to it is kept in ``Decision.verdicts``."""
    return _walk(req, backend, req.q.device.type)


def auto_backend(req: Request, device_type: str) -> Decision:
    """``auto``'s choice for ``req`` from the table of a device of this type (a parameter so the GPU
    table can be read on a machine without one)."""
    req.memo["device_type"] = device_type
    return _walk(req, "auto", device_type)


def _walk(req: Request, backend: str, device_type: str) -> Decision:
    kernels = _table.rows(device_type, backend)
    if not kernels:
        raise ValueError(f"backend={backend!r} has no kernel on {device_type}.")
    B, H, L, S, _, Dv, _ = req.shape
    if L == 0 or B == 0 or S == 0 or H == 0 or Dv == 0:  # no query rows (batch rows, heads), no key, no value dim:
        e = _table.kernel("eager")  # the same answer on every path (torch's flash kernel, the tile maps and the
        # compiled kernel divide by L, S and the head group; the NaN scan reads a row of Dv), from torch ops only
        what = ("no query rows (L = 0, B = 0 or H = 0): the empty output" if not (L and B and H) else
                "no key (S = 0): every query row sees no key, output 0 and lse -inf as any fully masked row" if not S
                else "no value dims (Dv = 0): the empty output, its lse as any call's")
        return Decision(e.backend, what, e.worker, e.why(req), None if device_type == "cuda" else True,
                        ((e.name, "runs"),), e)
    auto = backend == "auto"
    passed: list[tuple[Kernel, list[str], bool]] = []
    verdicts: list[tuple[str, str]] = []
    chosen = None
    wrapped = _wrapped(req)
    for k in kernels:
        # (its own checks not asked: some probe torch's kernels); named, the tiled backend's kernels too (their
        # autograd.Functions and data pointers fail inside torch's transforms), while torch SDPA's op runs under them
        if wrapped and k.reads_memory and (auto or k.backend == "tiled"):
            why = [f"tensors wrapped by a torch.func transform (grad, vmap, …): {k.title or k.name} reads the "
                   f"tensors' memory, which they have not (backend='auto' or 'eager' runs under the transforms)"]
        else:
            why = k.not_supported(req)
        if not why and auto:
            dec = k.declines(req)
            if dec is not None:
                passed.append((k, [dec], True))
                verdicts.append((k.name, f"declines: {dec}"))
                continue
        if why:
            passed.append((k, why, False))
            verdicts.append((k.name, "cannot: " + "; ".join(why)))
            continue
        chosen = k
        verdicts.append((k.name, "runs"))
        break
    if chosen is None:  # a named backend: its own precondition, else its first kernel's reasons
        own = None if auto else get(backend).unsupported(req)
        raise ValueError(f"backend={backend!r} cannot honour this call: {own or '; '.join(passed[0][1])}.")
    verdicts += [(k.name, "not asked") for k in kernels[len(verdicts):]]
    reason = chosen.auto_reason(req, passed) if auto else "asked for by name"
    worker_reason = chosen.why(req) + "".join(
        f" (not {k.title}: {'; '.join(rs)})" for k, rs, declined in passed
        if k.backend == chosen.backend and not declined and not k.specialist)
    return Decision(chosen.backend, reason, chosen.worker, worker_reason,
                    None if device_type == "cuda" else True, tuple(verdicts), chosen)


def _wrapped(req: Request) -> bool:
    """Whether a tensor of the call is wrapped by a torch.func transform (a functorch level is active and q, k,
    v, a tensor mask or a tensor the mask or score_mod reads is one of its tensors)."""
    import torch

    from . import _mods

    fn = torch._C._functorch
    if fn.maybe_current_level() is None:
        return False
    return (any(t is not None and fn.is_functorch_wrapped_tensor(t)
                for t in (req.q, req.k, req.v, req.dense_mask, req.bias))
            or _mods.reads_transformed(req.score_mod) or _mods.reads_transformed(req.mask))


def explain_decision(req: Request, backend: str) -> Decision:
    d = decide(req, backend)
    log.debug("attnkit.attention -> %s", d)
    return d
