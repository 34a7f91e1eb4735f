"""The backend layer: how attention is computed, one module per backend.

Every compute path is a declared kernel (``_kernel.Kernel``: ``not_supported``, ``declines``, ``why``,
``run``) living in the module that holds its code, and one row of its device's ordered table
(``_table``). A backend module exposes ``NAME``, ``unsupported(req) -> str | None`` (its
backend-wide precondition) and its kernels; ``attnkit._dispatch`` walks the table and never
reaches into a backend's internals.
"""

from __future__ import annotations

from .. import _calibrate
from . import _native, eager, flex, reference, sdpa, tiled

__all__ = ["get", "NAMES"]


def _calibrated_read_order(threads: int) -> str:
    """How the compiled kernel's decode entry reads K and V at ``threads``, by this machine's calibration:
    register-blocked at every size where it measured that faster over a long cache (an Intel Xeon with AMX, 2 threads,
    65 536 keys: GQA 32/8 1.16x the read against memory order's 1.32x; `python benchmarks/decode_splitk.py --order
    blocked|memory`), else today's rule (from 8 MB the order the kernel learns on each call shape's first calls,
    timing both: ``_native.learned_read_orders``). Asked once per prepared
    decode record; set here, where any import of the kernel's module passes, so a direct ``_native.decode`` follows
    the calibration as ``attention`` does."""
    return "blocked" if _calibrate.crossovers(threads).decode_order == "blocked" else "rule"


_native.read_order = _calibrated_read_order

_BACKENDS = {m.NAME: m for m in (reference, eager, sdpa, tiled, flex)}
NAMES = tuple(_BACKENDS)


def get(name: str):
    """The backend module called ``name``."""
    return _BACKENDS[name]
