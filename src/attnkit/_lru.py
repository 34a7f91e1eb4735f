"""Bounded caches that threads share: an ``OrderedDict`` kept oldest first, at most ``limit`` entries.

No check-then-act: another thread may evict an entry between a lookup and its move to the end, or empty the
cache while this one trims it; either is a miss or a no-op here, never a ``KeyError``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

MISSING = object()  # get()'s answer for a key not held (a cached value may itself be None)


def get(cache: OrderedDict, key, default=MISSING):
    """``cache[key]``, moved to the newest end; ``default`` where it is not held."""
    try:
        value = cache[key]
    except KeyError:
        return default
    with contextlib.suppress(KeyError):  # evicted by another thread meanwhile: the value is still this call's
        cache.move_to_end(key)
    return value


def put(cache: OrderedDict, key, value, limit: int) -> None:
    """``cache[key] = value`` as the newest entry; the oldest dropped beyond ``limit``."""
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > limit:
        try:
            cache.popitem(last=False)
        except KeyError:  # emptied by another thread meanwhile
            break
