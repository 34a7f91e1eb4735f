"""``attnkit.tile_mass``: attention over a long input, as the exact mass of every tile.

The door of the tile-mass engine (``attnkit/backends/_tilemass.py``, where the picture of what it
computes is): the same arguments as :func:`attnkit.attention`, checked in the same one place, then
the engine. ``TileMass.to_html`` and a notebook draw the result with :mod:`attnkit.viz`'s page.
"""

from __future__ import annotations

import numpy as np
import torch

from ._request import make_request
from .backends._tilemass import MAX_RUN, TileMass, run

__all__ = ["tile_mass", "TileMass", "MAX_RUN"]


def tile_mass(q, k, *, mask=None, causal: bool = False, scale=None, score_mod=None, block=None,
              max_run: int = MAX_RUN, workers: int | None = None) -> TileMass:
    """The exact attention mass of every tile of ``softmax(q kᵀ · scale)``, from q and k alone.

    The picture of how it is computed: ``attnkit/backends/_tilemass.py``.

    Shape legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
    D head dim.

    Args:
        q: ``(B, H, L, D)`` (or ``(H, L, D)``, ``(L, D)``), torch or NumPy.
        k: ``(B, Hkv, S, D)`` with ``H % Hkv == 0`` (GQA/MQA; K is never copied).
        mask, causal, scale, score_mod: as in :func:`attnkit.attention` (an attnkit mask, an
            :func:`attnkit.plan`, a mask_mod, a bool tensor or a float bias).
        block: tile shape ``(bm, bn)`` (one int for both); default ``(64, 64)``. A plan passed as
            ``mask`` gives its own (a different ``block`` beside it is refused).
        max_run: most keys in one GEMM.
        workers: threads over query blocks (default ``torch.get_num_threads()``); while they
            run, torch's intra-op threads are set to 1 (restored after).

    Returns:
        :class:`TileMass`. Its masses are the exact sums of the weights ``attention`` uses
        (checked against a float64 dense softmax in the tests); empty tiles of the plan are
        never computed; fully masked rows contribute 0.

    >>> L = 1024
    >>> q = k = torch.randn(1, 2, L, 32)
    >>> tm = attnkit.tile_mass(q, k, mask=attnkit.masks.sliding_window(128), block=128)
    >>> tm.shape, tm.tiles.shape[0], round(float(tm.mass[0, 0].sum()))   # every row sums to 1
    ((8, 8), 15, 1024)
    """
    # v plays no part in the weights: a one-column view of k stands in (no copy)
    v = k[..., :1] if isinstance(k, (torch.Tensor, np.ndarray)) and k.ndim >= 2 else k
    req = make_request(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod,
                       dropout_p=0.0, return_lse=False, backend="auto")
    return run(req, block=block, max_run=max_run, workers=workers)
