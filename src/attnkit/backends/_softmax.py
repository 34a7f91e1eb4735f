"""The shared math of exact attention, in one place (FlashAttention's names: ``m_i``, ``l_i``, ``acc``).

Every torch path uses these and nothing else for the softmax bookkeeping: the tiled
plain worker (the online update), the tiled fused worker and context-parallel rings
(the log-sum-exp merge of partial results), eager (the row softmax), and exact weights
recomputed from lse (``attention(..., return_weights=...)``, the transformers integration).

Online softmax over runs of keys of one block of query rows::

    m_new = max(m_i, rowmax(s))                 running row max
    p     = exp(s - m_new)                      this run's unnormalised weights
    alpha = exp(m_i - m_new)                    rescales what was summed so far
    l_i   = alpha·l_i + rowsum(p)               running denominator
    acc   = alpha·acc + p·v                     running numerator
    out   = acc / l_i,  lse = m_i + log(l_i)    at the end

The dead-row guard: a row with no visible key has every score -inf, so m_i = -inf
and ``s - m_i`` would be ``-inf - (-inf) = NaN``. The max that is *subtracted* is
clamped to the dtype's lowest finite value (``guard``), so ``exp`` gives 0, l_i stays
0 and the row ends with out = 0, lse = -inf — never NaN::

    s = [-inf, -inf]   m_i = -inf   m_use = lowest   p = exp(-inf - lowest) = [0, 0]
    l_i = 0   out = acc / 1 = 0   lse = -inf + log 0 = -inf

Merging two partial results of the same rows over disjoint key sets (a ring step, a
second run): weights ``exp(lse_a - m)`` and ``exp(lse_b - m)`` with the guarded
``m = max(lse_a, lse_b)``. :func:`merge` keeps whatever dtype it is given, so callers
pass fp32 accumulators for bf16/fp16 inputs and round once, at the very end.

Weights from lse, and where they are not exact (issue 18). The backward (FA2) saves only
``lse = m_i + log l_i`` and rebuilds ``p = exp(s - lse)``. Rounding lse to its dtype moves it
by up to ``|lse|·u`` (u = 2^-24 in fp32), so ``p`` is off by that factor: nothing for an
ordinary row (|lse| of a few tens), everything on a row whose scores are all a huge finite
negative (``finfo.min`` padding, ``masked_fill(-1e9)``): there ``log l_i`` is lost entirely
(``finfo.min + log 8 == finfo.min`` in fp32), every weight comes out 1 instead of 1/S::

    s   = [min, min, min, min]        (fp32-rounded scores: finfo.min + q·k == finfo.min)
    lse = m_i + log l_i = min + 1.39 → min        p = exp(s - lse) = [1, 1, 1, 1]   wrong
    m_i = min, l_i = 4                           p = exp(s - m_i) / l_i = [¼, ¼, ¼, ¼]   right

:func:`inexact_rows` finds such rows from lse alone (O(L), no pass over the scores): those
with ``|lse| > LSE_EXACT_MAX``; backends recompute them from their own ``(m_i, l_i)``
(:func:`softmax_lse` on the row's scores) and keep ``exp(s - lse)`` for the rest.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["guard", "nonfinite_keys", "weigh_values", "online_step", "online_finish", "merge", "softmax_lse",
           "lse_for_backward", "weights_from_lse", "inexact_rows", "any_inexact", "split_inexact", "LSE_EXACT_MAX",
           "add_sink"]

# Above this |lse|, exp(s - lse) is not trusted. Error budget: rounding lse costs a relative
# error of at most |lse|·u in every weight rebuilt from it; at 2^8 that is 2^8·u = 2^-16 ≈ 1.5e-5
# in fp32 (bf16/fp16 keep lse in fp32) and 2^-45 in fp64 — below the fp32 gradient budget of
# the tests (32 · 16 eps (√D + √S)) — while ordinary rows (|lse| ≲ 100: scores past that are
# already one-hot) never cross it, so the exact recomputation runs only on padding-like rows.
LSE_EXACT_MAX = 2.0 ** 8


def guard(m: torch.Tensor) -> torch.Tensor:
    """The dead-row guard: a row max safe to subtract (-inf → the dtype's lowest finite value)."""
    return m.clamp_min(torch.finfo(m.dtype).min)


def nonfinite_keys(fin: torch.Tensor) -> torch.Tensor:
    """The keys (dim -2, ascending) whose value holds NaN or inf in some leading row (batch, head), from ``fin =
    torch.isfinite(v)`` (``v (…, n, Dv)``)."""
    return (~fin).any(-1).reshape(-1, fin.shape[-2]).any(0).nonzero().flatten()


def weigh_values(p: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """``p @ v`` (``p (…, rows, n)``, ``v (…, n, Dv)``), where a value the mask hides from a row (``hidden``, bool,
    broadcastable to ``p``) is never read: a NaN or inf in V at a key hidden from a row does not reach it, as in
    the compiled kernel, which never reads a hidden key (the matmul alone would give ``0 · NaN = NaN``). Nor does
    its gradient (no ``0 · NaN`` in the backward either). One matmul where nothing is hidden (callers pass
    ``hidden`` only for a V holding NaN / inf); else the finite part by one matmul and the keys holding NaN / inf
    added in chunks no larger than ``p``.
    ::

        hidden row i, key j (·):   p_ij = 0,  v_j = NaN   →   p @ v: row i NaN;   here: row i untouched
    """
    if hidden is None:
        return torch.matmul(p, v)
    n, dv = v.shape[-2], v.shape[-1]
    fin, zero = torch.isfinite(v), torch.zeros((), dtype=v.dtype, device=v.device)
    out = torch.matmul(p, torch.where(fin, v, zero))
    bad = torch.where(fin, zero, v)  # only the NaN / inf entries
    keys = nonfinite_keys(fin)
    step = max(1, n // max(1, dv))
    for c in range(0, keys.numel(), step):
        j = keys[c:c + step]
        hj = hidden.index_select(-1, j).unsqueeze(-1)  # (…, rows, c, 1)
        vj = bad.index_select(-2, j).unsqueeze(-3)  # (…, 1, c, Dv)
        out = out + (p.index_select(-1, j).unsqueeze(-1) * torch.where(hj, zero, vj)).sum(-2)
    return out


def online_step(m_i, l_i, acc, s: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None = None):
    """Fold one run of scores ``s (…, rows, n)`` (consumed in place) and values ``v (…, n, Dv)``
    into the running ``(m_i, l_i, acc)`` (all None before the first run); ``hidden``: the points the mask
    hides, whose values are not read (:func:`weigh_values`; None: V is finite, or nothing hidden)."""
    m_new = s.amax(dim=-1, keepdim=True)
    if m_i is not None:
        m_new = torch.maximum(m_i, m_new)
    m_use = guard(m_new)
    p = s.sub_(m_use).exp_()
    pv = weigh_values(p, v, hidden)
    if m_i is None:
        return m_new, p.sum(dim=-1, keepdim=True), pv
    alpha = (m_i - m_use).exp_()
    return m_new, l_i.mul_(alpha).add_(p.sum(dim=-1, keepdim=True)), acc.mul_(alpha).add_(pv)


def online_finish(m_i, l_i, acc):
    """``(out, lse)`` from the running statistics: ``acc / l_i`` (0 on dead rows), ``m_i + log l_i``."""
    out = acc.div_(torch.where(l_i > 0, l_i, torch.ones_like(l_i)))
    return out, (m_i + torch.log(l_i)).squeeze(-1)


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial results of the same query rows over disjoint keys.

    ``out_* (…, rows, Dv)`` and ``lse_* (…, rows)`` in the accumulator dtype (fp32 for
    bf16/fp16 work, so rounding happens once, after the last merge). A side with
    lse = -inf (no visible key) contributes nothing; both dead gives out 0, lse -inf.
    """
    m = guard(torch.maximum(lse_a, lse_b))
    w_a, w_b = (lse_a - m).exp(), (lse_b - m).exp()
    tot = w_a + w_b
    safe = torch.where(tot > 0, tot, torch.ones_like(tot))
    out = out_a * (w_a / safe).unsqueeze(-1) + out_b * (w_b / safe).unsqueeze(-1)
    return out, m + torch.log(tot)


def softmax_lse(s: torch.Tensor):
    """Row softmax of dense scores ``s (…, S)`` and its lse; dead rows give weights 0, lse -inf."""
    if s.shape[-1] == 0:  # no key (S = 0): every row is a fully masked row
        return s * 0, s.sum(dim=-1) - float("inf")  # (empty weights; lse -inf: no key)
    m_i = guard(s.detach().amax(dim=-1, keepdim=True))
    p = torch.exp(s - m_i)  # s - m_i is exact near the max, even at finfo.min: weights exact on any row
    l_i = p.sum(dim=-1, keepdim=True)
    live = ~(l_i <= 0)  # a NaN sum (NaN or +inf in the scores) is live: the row's weights, lse and gradients NaN
    safe = torch.where(live, l_i, torch.ones_like(l_i))  # log(0)'s gradient would be NaN, even masked
    lse = torch.where(live, m_i + torch.log(safe), torch.full_like(m_i, float("-inf")))
    return p / safe, lse.squeeze(-1)


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """lse with dead rows at +inf, so a recomputed ``p = exp(s - lse)`` is 0 on the whole row."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def inexact_rows(lse: torch.Tensor) -> torch.Tensor:
    """Rows (bool, lse's shape) where ``exp(s - lse)`` is not exact: finite ``|lse| > LSE_EXACT_MAX``
    (see the module docstring). One elementwise pass over lse: O(B·H·L)."""
    return (lse.abs() > LSE_EXACT_MAX) & torch.isfinite(lse)


_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def any_inexact(lse: torch.Tensor) -> bool:
    """Whether any row of ``lse`` is one of :func:`inexact_rows` — on a plain CPU tensor by NumPy on its memory (a
    kernel backward asks once per call: ~2 µs against the torch ops' ~28 for a decode step's few rows)."""
    if lse.device.type == "cpu" and lse.dtype in _NUMPY_FLOATS and type(lse) is torch.Tensor and \
            not torch._C._functorch.is_functorch_wrapped_tensor(lse):
        a = np.abs(lse.detach().numpy(force=False))
        if a.size == 0 or a.max() <= LSE_EXACT_MAX:  # (the usual answer, in one reduction)
            return False
        return bool(((a > LSE_EXACT_MAX) & (a != np.inf)).any())  # (NaN: neither)
    return bool(inexact_rows(lse).any())


def split_inexact(lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None):
    """``(rows, dout, dlse)`` for a backward: the query rows ``(L,)`` where some (batch, head) row of ``lse (B, H,
    L)`` is one of :func:`inexact_rows` — None where there is none (one NumPy reduction: :func:`any_inexact`) — and
    ``dout`` / ``dlse`` with those rows zeroed, so a worker's share there is exactly 0 (the caller adds the exact one:
    ``_tiles.exact_rows_backward``); ``dout`` / ``dlse`` as given where ``rows`` is None."""
    if not any_inexact(lse):
        return None, dout, dlse
    rows = inexact_rows(lse).flatten(0, 1).any(0)
    return rows, dout.masked_fill(rows.unsqueeze(-1), 0), None if dlse is None else dlse.masked_fill(rows, 0)


def weights_from_lse(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Exact weights from scores ``s (…, L, S)`` and ``lse (…, L)``; dead rows 0.

    ``exp(s - lse)``, except on :func:`inexact_rows`, whose weights are the row's own softmax
    ``exp(s - m_i) / l_i`` (the whole row is at hand here)."""
    p = torch.exp(s - lse_for_backward(lse).unsqueeze(-1))
    bad = inexact_rows(lse)
    if torch._C._functorch.maybe_current_level() is not None or bool(bad.any()):  # (a transform: not asked)
        p = torch.where(bad.unsqueeze(-1), softmax_lse(s)[0], p)
    return p


def add_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor):
    """Attention sinks (GPT-OSS's ``s_aux``): one extra logit per row in the softmax denominator
    that attends to nothing. ``lse' = log(e^lse + e^sink)``, ``out' = out · e^(lse - lse')``.

    Differentiable in out, lse and sink; a row with lse = -inf and sink = -inf stays 0 / -inf
    with zero gradients (the -inf values never enter an exp or log on the autograd path).
    """
    sink = sink.to(lse.dtype).expand_as(lse)
    dead = torch.isneginf(lse) & torch.isneginf(sink)
    zero = torch.zeros_like(lse)
    a, b = torch.where(dead, zero, lse), torch.where(dead, zero, sink)
    lse2 = torch.logaddexp(a, b)
    keep = torch.where(dead, zero, torch.exp(a - lse2))  # share of the row left to the keys
    return out * keep.unsqueeze(-1).to(out.dtype), torch.where(dead, torch.full_like(lse, float("-inf")), lse2)
