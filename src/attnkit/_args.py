"""Integer arguments as torch takes them: a Python ``int``, a NumPy integer or a one-element integer tensor (what
``operator.index`` accepts), never a bool (``True`` is not a size) nor a float (``3.0`` is refused, not rounded).
A leaf module: every layer's argument checks use it, so a NumPy size works everywhere or nowhere."""

from __future__ import annotations

import operator

__all__ = ["as_int"]


def as_int(value) -> int | None:
    """``value`` as a Python int where it is an integer (see the module docstring), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int(value)
    if str(getattr(value, "dtype", "")) in ("torch.bool", "bool"):  # a bool tensor / NumPy bool: not a size
        return None
    try:
        return operator.index(value)
    except (TypeError, ValueError, RuntimeError):
        return None
