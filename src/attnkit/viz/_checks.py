"""Argument checks shared by the pages and pictures."""

from __future__ import annotations

__all__ = ["need_kind"]


def need_kind(name: str, obj, attrs, expected: str, fix: str) -> None:
    """A TypeError naming ``name`` where ``obj`` lacks one of ``attrs`` (a tensor handed to a page that draws a
    trace: Python's own error said "'Tensor' object has no attribute 'q'")."""
    if not all(hasattr(obj, a) for a in attrs):
        raise TypeError(f"{name}: expected {expected}, got {type(obj).__name__}. {fix}.")
