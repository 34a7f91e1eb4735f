"""attnkit: exact Transformer attention, from the textbook formula to fused kernels.

Shape legend (used in every docstring):
    B batch · H query heads · Hkv key/value heads · L query length · S key length ·
    D head dim · Dv value head dim.  q (B, H, L, D), k (B, Hkv, S, D),
    v (B, Hkv, S, Dv) → out (B, H, L, Dv), lse (B, H, L).

Conventions: bool masks are True = attend; float masks are additive biases;
causal with L ≠ S is bottom-right aligned; a fully masked row gives 0 (lse -inf).
"""

from __future__ import annotations

import importlib as _importlib
import importlib.util as _importlib_util
import sys as _sys
import types as _types
from typing import TYPE_CHECKING

from . import _display

__all__ = ["attention", "flex_attention", "dispatch", "explain", "tile_mass", "plan", "create_block_mask", "BlockPlan",
           "Decision", "Trace", "TileMass", "masks", "plans", "score_mods", "positional", "nn"]
__version__ = "0.1.0"

# The public names and the module each comes from, imported on first use rather than by `import attnkit`: they
# import torch (seconds), and the command line (`attnkit --help`, `attnkit --version`) needs none of it.
# `attnkit.attention(...)`, `from attnkit import attention` and `dir(attnkit)` behave as if imported eagerly.
_API = {"attention": "api", "flex_attention": "_flex_api", "dispatch": "api", "explain": "explain", "plan": "plans",
        "create_block_mask": "plans", "BlockPlan": "plans", "Decision": "_dispatch", "Trace": "backends.reference",
        "tile_mass": "tilemass", "TileMass": "tilemass"}

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from . import masks, nn, plans, positional, score_mods
    from ._dispatch import Decision
    from ._flex_api import flex_attention
    from .api import attention, dispatch
    from .backends.reference import Trace
    from .explain import explain
    from .plans import BlockPlan, create_block_mask, plan
    from .tilemass import TileMass, tile_mass


def __getattr__(name: str):
    if name in _API:
        value = getattr(_importlib.import_module(f"{__name__}.{_API[name]}"), name)
        globals()[name] = value  # from now on a plain attribute
        return value
    if not name.startswith("__") and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
        return _importlib.import_module(f"{__name__}.{name}")  # a submodule: attnkit.masks, attnkit.backends, ...
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(_types.ModuleType):
    """attnkit's module type: ``attnkit.explain`` stays the function when the submodule of the same name
    (``attnkit/explain.py``) is imported, which the import system would otherwise bind in its place."""

    def __setattr__(self, name: str, value) -> None:
        if name in _API and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


def _render_html(kind: str, obj, **options) -> str:
    """What the ``_repr_html_`` of a mask, plan, decision, trace or tile-mass map shows: drawn by
    :mod:`attnkit.viz`, imported on the first display (the core itself never imports the renderer)."""
    from .viz._html_repr import render

    return render(kind, obj, **options)


_display.register(_render_html)
