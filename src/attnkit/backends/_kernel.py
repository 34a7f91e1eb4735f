"""A compute path as a declared object: what it cannot do, when ``auto`` passes it over, what it runs.

Every way attnkit can compute attention is one :class:`Kernel` in the module that holds its code
(``sdpa.FUSED``, ``native.NATIVE``, ``tiled.FLASH_RUNS`` …) and one row of the ordered table of its
device (:mod:`attnkit.backends._table`). ``attnkit.dispatch`` walks that table and nothing else::

    row          not_supported(req)            declines(req) (auto only)        verdict
    sdpa         []                            "causal at L >= 64: native …"   passed over
    native       []                            None                             runs  <- chosen
    flash-runs   (not asked)

* ``not_supported(req)``: **every** reason the kernel cannot run the call exactly (an empty list: it
  can). A named backend (``backend="tiled"``) runs the first of its kernels with none.
* ``declines(req)``: ``auto`` only: the measured reason another kernel is faster or leaner for this
  call (None: this kernel is auto's choice once it can run it). ``measured`` names the benchmark
  that set the rule.
* ``why(req)``: one line saying what runs (``Decision.worker_reason``); ``run(req)``: ``(out, lse | None)``,
  with the kernel's own autograd.

``not_supported`` may leave what it prepared to decide (row intervals, a tile map, a score_mod
program) in ``req.memo`` for ``run``: the memo lives and dies with the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._base import Request

__all__ = ["Kernel"]


class Kernel:
    """One compute path (see the module docstring). Subclasses set the class attributes and override
    ``not_supported``, ``why`` and ``run``; ``declines`` and ``auto_reason`` where auto needs them."""

    name: str = ""  # the row's name in dispatch's table
    backend: str = ""  # the backend= name that selects it
    worker: str = ""  # Decision.worker when it runs
    title: str = ""  # how a reason names it ("the compiled kernel")
    devices: tuple[str, ...] = ("cpu", "cuda")
    measured: str = ""  # the benchmark behind its place in the table, and its result
    # a kernel for one kind of call only (the decode entry): why it passed a call is in the table's verdicts,
    # not repeated in the reason of the kernel that ran
    specialist: bool = False
    # reads the tensors' memory (data pointers, NumPy): cannot run tensors a torch.func transform wraps (grad, vmap,
    # jacrev …), which have none; dispatch passes such calls over it (the eager path's torch ops run them)
    reads_memory: bool = True

    def not_supported(self, req: Request) -> list[str]:
        """Every reason this kernel cannot run ``req`` exactly (empty: it can)."""
        return [] if req.device_type in self.devices else [f"tensors on {req.device_type} "
                                                              f"({self.title or self.name} runs on "
                                                              f"{' / '.join(self.devices)})"]

    def declines(self, req: Request) -> str | None:
        """``auto`` only: why another kernel should run this call although this one can (None: run it)."""
        return None

    def backward_flaw(self, req: Request) -> str | None:
        """Why this kernel's own autograd would be inexact for ``req`` (None: it would not)."""
        return None

    def why(self, req: Request) -> str:
        """What runs, in one line (``Decision.worker_reason``)."""
        return self.title

    def auto_reason(self, req: Request, passed: list[tuple[Kernel, list[str], bool]]) -> str:
        """``Decision.reason`` when ``auto`` chose this kernel after passing over ``passed``:
        (kernel, its reasons, True when it declined rather than could not)."""
        if passed:
            return "; ".join(passed[0][1])
        return self.why(req)

    def run(self, req: Request):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"
