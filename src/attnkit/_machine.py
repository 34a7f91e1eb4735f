"""What this machine has, read once where a size is checked before anything is allocated."""

from __future__ import annotations

import os

__all__ = ["physical_memory"]


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (POSIX ``sysconf``), or None where the system cannot say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
