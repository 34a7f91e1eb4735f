"""``attnkit.explain``: every step of attention on your own numbers."""

from __future__ import annotations

from ._request import make_request
from .reference import Trace, trace

__all__ = ["explain"]


def explain(q, k, v, *, mask=None, causal=False, scale=None, score_mod=None) -> Trace:
    """Run the float64 reference and keep every intermediate.

    Takes the same arguments as :func:`attnkit.attention` (no dropout). Returns a
    :class:`attnkit.Trace` with ``scores (B, H, L, S)``, ``scaled``, ``masked``,
    ``weights``, ``output (B, H, L, Dv)`` and ``lse (B, H, L)`` as float64 arrays;
    ``print(trace)`` shows them as tables.

    >>> t = attnkit.explain(np.array([[1., 0], [0, 1], [1, 1]]),
    ...                     np.array([[1., 1], [1, 0], [0, 1]]),
    ...                     np.array([[10., 0], [0, 10], [5, 5]]))
    >>> t.output[0, 0, 0]          # the seed's first row, corrected
    array([5., 5.])
    """
    req = make_request(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod,
                       dropout_p=0.0, return_lse=True, backend="reference")
    return trace(req)
