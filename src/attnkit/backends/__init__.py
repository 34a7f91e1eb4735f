"""Backend registry. Each backend module exposes ``NAME``, ``unsupported(req) -> str | None``
(why it cannot honour a request, or None) and ``run(req) -> (out, lse | None)``."""

from __future__ import annotations

import importlib

__all__ = ["get"]

_MODULES = {
    "reference": "attnkit.reference",
    "eager": "attnkit.backends.eager",
    "sdpa": "attnkit.backends.sdpa",
    "tiled": "attnkit.backends.tiled",
}


def get(name: str):
    return importlib.import_module(_MODULES[name])
