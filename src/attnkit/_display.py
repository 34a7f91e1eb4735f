"""Rich display (``_repr_html_``) by registration: the core draws nothing and imports no renderer.

The objects a notebook shows (a mask, a :class:`~attnkit.BlockPlan`, a dispatch
:class:`~attnkit.Decision`, a :class:`~attnkit.Trace`, a tile-mass map) define ``_repr_html_`` as
``_display.html(KIND, self)``. What draws each kind is registered from above: the package
(``attnkit/__init__.py``) registers :mod:`attnkit.viz`, imported on the first display, so
``import attnkit`` stays light and no module below the renderer imports it::

    attnkit/__init__.py ──register──► _display ◄──html(kind, obj)── masks, plans, _dispatch,
            │                                                      backends.reference, tile mass
            └──(on the first display)──► viz._html_repr.render(kind, obj)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["html", "register"]

KINDS = ("mask", "plan", "decision", "trace", "tile_mass")

_RENDER: list[Callable[..., str]] = []  # the one registered renderer (empty: none yet)


def register(render: Callable[..., str]) -> None:
    """Make ``render(kind, obj, **options) -> str`` draw every kind in :data:`KINDS` (replaces any before)."""
    _RENDER[:] = [render]


def html(kind: str, obj: Any, **options: Any) -> str | None:
    """The HTML of ``obj`` drawn as ``kind``; None when no renderer is registered (a notebook then
    shows the plain ``repr``)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}.")
    return _RENDER[0](kind, obj, **options) if _RENDER else None
