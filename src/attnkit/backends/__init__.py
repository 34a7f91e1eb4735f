"""The backend layer: how attention is computed, one module per backend.

Every backend module has the same small interface (see ``_base``)::

    NAME                          its name in attention(..., backend=NAME)
    unsupported(req) -> str|None  why it cannot honour a request exactly (None: it can)
    choose_worker(req) -> (worker, why)   which of its code paths would run, and why
    run(req, worker) -> (out, lse | None)

``attnkit._dispatch`` asks ``unsupported`` and ``choose_worker`` and reports both
choices; it never reaches into a backend's internals.
"""

from __future__ import annotations

from . import eager, flex, reference, sdpa, tiled

__all__ = ["get", "NAMES"]

_BACKENDS = {m.NAME: m for m in (reference, eager, sdpa, tiled, flex)}
NAMES = tuple(_BACKENDS)


def get(name: str):
    """The backend module called ``name``."""
    return _BACKENDS[name]
