"""The ordered tables of declared kernels, one per device: the one place that decides which kernel runs.

``auto`` runs the first row whose kernel can run the call (``not_supported`` empty) and does not
decline it (``declines``: a measured preference for a later row). A named backend runs the first row
of that backend that can run the call, declines ignored. Rows marked ``auto=False`` serve named
backends only. A new kernel is one class (:class:`attnkit.backends._kernel.Kernel`) and one row here.

CPU (auto order)::

    native-decode  the compiled kernel's decode entry           a few query rows over a cache, no gradient
    sdpa         torch SDPA (+ the grouped-query decode fold)   declines what the rows below do faster
    sdpa-fp32    torch SDPA in fp32 on widened bf16 copies      bf16 with gradients SDPA keeps, no bf16 instructions
    native       attnkit's compiled kernel                      any mask the plan describes, bool tensors, score_mods
    flash-runs   torch's flash kernel per run of keys           masks the kernel cannot take (a float mask)
    plain        the tile loop in torch ops                     anything else, exact gradients
    eager        dense scores in torch ops                      dropout; the last resort

CUDA: ``sdpa`` (dense and causal), ``flex`` (masks and score_mods), ``plain``, ``eager``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import eager, flex, native, reference, sdpa, tiled
from ._base import Request
from ._kernel import Kernel

__all__ = ["Row", "TABLES", "rows", "kernel"]


class ExactBackward(Kernel):
    """``backend="sdpa"`` with gradients SDPA's own autograd would get wrong (:func:`sdpa.backward_flaw`):
    the tiled engine runs the call (its first kernel that can), whose backward is exact there."""

    name = "sdpa-exact"
    backend = "sdpa"
    worker = "tiled"
    title = "the tiled engine (SDPA's backward is inexact here)"

    def not_supported(self, req: Request) -> list[str]:
        why = [w for w in (sdpa.unsupported(req),) if w is not None]
        if sdpa.backward_flaw(req) is None:
            why.append("SDPA's own backward is exact here")
        if req.dropout_p > 0:
            why.append("dropout (the tiled engine has none)")
        return why

    @staticmethod
    def _inner(req: Request) -> Kernel:
        for k in (native.NATIVE, tiled.FLASH_RUNS, tiled.PLAIN):
            if not k.not_supported(req):
                return k
        return tiled.PLAIN

    def why(self, req: Request) -> str:
        k = self._inner(req)
        return (f"{sdpa.backward_flaw(req)}; the same CPU flash kernel through the tiled engine "
                f"({k.worker} worker: {k.why(req)})")

    def run(self, req: Request):
        out, lse = self._inner(req).run(req)
        return out, (lse if req.need_lse else None)


EXACT = ExactBackward()


@dataclass(frozen=True)
class Row:
    kernel: Kernel
    auto: bool = True  # False: a named backend's row only


TABLES: dict[str, tuple[Row, ...]] = {
    "cpu": (Row(native.NATIVE_DECODE), Row(sdpa.FUSED), Row(sdpa.WIDENED), Row(sdpa.MATH, auto=False),
            Row(EXACT, auto=False),
            Row(native.NATIVE), Row(tiled.FLASH_RUNS), Row(tiled.PLAIN), Row(flex.FLEX, auto=False), Row(eager.EAGER),
            Row(reference.REFERENCE, auto=False)),
    "cuda": (Row(sdpa.FUSED), Row(sdpa.MATH, auto=False), Row(EXACT, auto=False), Row(flex.FLEX),
             Row(tiled.PLAIN), Row(eager.EAGER), Row(reference.REFERENCE, auto=False)),
}


def rows(device_type: str, backend: str) -> tuple[Kernel, ...]:
    """The kernels ``backend`` (``"auto"`` or a backend name) may run on a device of this type, in order."""
    table = TABLES.get(device_type, TABLES["cuda"])  # any other accelerator: the GPU table
    if backend == "auto":
        return tuple(r.kernel for r in table if r.auto)
    return tuple(r.kernel for r in table if r.kernel.backend == backend)


def kernel(name: str) -> Kernel:
    """The declared kernel called ``name`` (a row of some table)."""
    for table in TABLES.values():
        for r in table:
            if r.kernel.name == name:
                return r.kernel
    raise KeyError(name)
