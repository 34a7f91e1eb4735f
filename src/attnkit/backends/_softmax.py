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
"""

from __future__ import annotations

import torch

__all__ = ["guard", "online_step", "online_finish", "merge", "softmax_lse", "lse_for_backward", "weights_from_lse",
           "add_sink"]


def guard(m: torch.Tensor) -> torch.Tensor:
    """The dead-row guard: a row max safe to subtract (-inf → the dtype's lowest finite value)."""
    return m.clamp_min(torch.finfo(m.dtype).min)


def online_step(m_i, l_i, acc, s: torch.Tensor, v: torch.Tensor):
    """Fold one run of scores ``s (…, rows, n)`` (consumed in place) and values ``v (…, n, Dv)``
    into the running ``(m_i, l_i, acc)`` (all None before the first run)."""
    m_new = s.amax(dim=-1, keepdim=True)
    if m_i is not None:
        m_new = torch.maximum(m_i, m_new)
    m_use = guard(m_new)
    p = s.sub_(m_use).exp_()
    pv = torch.matmul(p, v)
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
    m = guard(s.detach().amax(dim=-1, keepdim=True))
    p = torch.exp(s - m)
    l_i = p.sum(dim=-1, keepdim=True)
    live = l_i > 0
    safe = torch.where(live, l_i, torch.ones_like(l_i))  # log(0)'s gradient would be NaN, even masked
    lse = torch.where(live, m + torch.log(safe), torch.full_like(m, float("-inf")))
    return p / safe, lse.squeeze(-1)


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """lse with dead rows at +inf, so a recomputed ``p = exp(s - lse)`` is 0 on the whole row."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def weights_from_lse(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Exact weights ``exp(s - lse)`` from scores ``s (…, L, S)`` and ``lse (…, L)``; dead rows 0."""
    return torch.exp(s - lse_for_backward(lse).unsqueeze(-1))


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
