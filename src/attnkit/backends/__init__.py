"""The backend layer: how attention is computed, one module per backend.

Every compute path is a declared kernel (``_kernel.Kernel``: ``not_supported``, ``declines``, ``why``,
``run``) living in the module that holds its code, and one row of its device's ordered table
(``_table``). A backend module exposes ``NAME``, ``unsupported(req) -> str | None`` (its
backend-wide precondition) and its kernels; ``attnkit._dispatch`` walks the table and never
reaches into a backend's internals.
"""

from __future__ import annotations

from . import eager, flex, reference, sdpa, tiled

__all__ = ["get", "NAMES"]

_BACKENDS = {m.NAME: m for m in (reference, eager, sdpa, tiled, flex)}
NAMES = tuple(_BACKENDS)


def get(name: str):
    """The backend module called ``name``."""
    return _BACKENDS[name]
