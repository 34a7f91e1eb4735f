"""``attnkit.explain``: every step of attention on your own numbers."""

from __future__ import annotations

from ._request import make_request
from .backends.reference import Trace, trace

__all__ = ["explain"]


def explain(q, k, v, *, mask=None, causal=False, scale=None, score_mod=None) -> Trace:
    """Run the float64 reference and keep every intermediate.

    Takes the same arguments as :func:`attnkit.attention` (no dropout):
    q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), or unbatched (L, D) / (H, L, D).
    Returns a :class:`attnkit.Trace` whose float64 arrays follow the input rank (the
    rank rule), like the output of :func:`attnkit.attention`:

    ======================  ================  ==============  ===============
    input                   scores … weights  output          lse
    ======================  ================  ==============  ===============
    (L, D)                  (L, S)            (L, Dv)         (L,)
    (H, L, D)               (H, L, S)         (H, L, Dv)      (H, L)
    (B, H, L, D)            (B, H, L, S)      (B, H, L, Dv)   (B, H, L)
    ======================  ================  ==============  ===============

    ``scores``, ``scaled``, ``masked``, ``allowed`` and ``weights`` share the scores'
    shape; ``print(trace)`` shows them as tables.

    >>> t = attnkit.explain(np.array([[1., 0], [0, 1], [1, 1]]),
    ...                     np.array([[1., 1], [1, 0], [0, 1]]),
    ...                     np.array([[10., 0], [0, 10], [5, 5]]))
    >>> t.weights[0].round(4)      # the 3-token example: (L, S) for (L, D) inputs
    array([0.4011, 0.4011, 0.1978])
    >>> t.output[0]                # its first output row
    array([5., 5.])
    """
    req = make_request(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod,
                       dropout_p=0.0, return_lse=True, backend="reference")
    return trace(req).at_rank(req.input_rank)
