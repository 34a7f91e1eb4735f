"""torch's private CPU flash-attention kernel, in exactly one place: probe, layout contract, quirks.

The ops (``torch.ops.aten``, present since torch 2.2, not public API)::

    _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)
        -> (out (B, H, L, Dv), lse (B, H, L) fp32)
    _scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, dropout_p,
        is_causal, *, attn_mask, scale) -> (dq, dk, dv)

**Layout contract** (:func:`fit`, applied to every tensor argument of every call here):
the kernel reads each row of q, k, v (and the mask, out, dout) as contiguous memory,
so a tensor whose **last dim has stride ≠ 1** (``x[..., ::2]``, a transposed view,
``as_strided``) gives wrong values with no error. Such a tensor is copied here; any
other stride pattern (sliced or transposed leading dims, stride-0 broadcasts,
overlapping rows) is read correctly and passed through without a copy.

**Quirks handled here, once:**

* a row with no visible key (its mask row all ``-inf``) gets lse ``0``, not ``-inf``:
  :func:`forward` patches such rows to ``-inf`` (its output is already 0);
* a row whose scores hold NaN (or an inf) may come out as zeros (NaN hidden): callers that
  promise NaN propagation route NaN / inf inputs to a plain-op path (:func:`has_nonfinite`);
* no GQA switch: K/V heads must equal the query heads of the call (callers fold the
  ``g`` query heads of a kv head into the rows, so nothing is copied).

**Probe** (:func:`available`): on first use, check the ops exist and agree with a
float64 softmax on a tiny masked case. If not (a torch release renamed or changed
them), warn once and report unavailable: the tiled backend then runs its plain worker
and ``sdpa`` computes lse by plain ops — slower, still exact.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["available", "forward", "backward", "fit", "has_nonfinite"]

_FWD_NAME = "_scaled_dot_product_flash_attention_for_cpu"
_BWD_NAME = "_scaled_dot_product_flash_attention_for_cpu_backward"

_state: dict = {}  # "ok": bool, "why": str; filled by the probe, once per process


def fit(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` itself when the kernel reads it correctly, else a copy whose last dim is contiguous."""
    if t is None or t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] == 1:
        return t
    return t.contiguous()


def _ops():
    return getattr(torch.ops.aten, _FWD_NAME), getattr(torch.ops.aten, _BWD_NAME)


def _probe() -> tuple[bool, str]:
    try:
        fwd, bwd = _ops()
    except (AttributeError, RuntimeError) as e:
        return False, f"torch.ops.aten.{_FWD_NAME} is missing ({e})"
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))
        mask = torch.zeros(1, 1, 3, 3)
        mask[..., 0, 1:] = float("-inf")
        out, lse = fwd(q, k, v, 0.0, False, attn_mask=mask, scale=0.5)
        s = (q.double() @ k.double().transpose(-1, -2)) * 0.5 + mask.double()
        want_lse = torch.logsumexp(s, -1)
        want = torch.softmax(s, -1) @ v.double()
        if (out.double() - want).abs().max() > 1e-5 or (lse.double() - want_lse).abs().max() > 1e-5:
            return False, "its forward disagrees with a float64 softmax on a probe"
        dq, dk, dv = bwd(torch.ones_like(out), q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=0.5)
        if dq.shape != q.shape or dk.shape != k.shape or dv.shape != v.shape:
            return False, "its backward returns unexpected shapes"
    except Exception as e:
        return False, f"calling it failed ({type(e).__name__}: {e})"
    return True, ""


def available() -> bool:
    """Whether the private kernel is present and behaves as expected (probed once)."""
    if "ok" not in _state:
        ok, why = _probe()
        if not ok and torch._C._functorch.maybe_current_level() is not None:
            return False  # probed inside a torch.func transform (its random tensors refused there): not a verdict
        _state["ok"], _state["why"] = ok, why
        if not ok:
            warnings.warn(
                f"attnkit: torch's private CPU flash kernel is unavailable: {why}. The tiled backend runs its "
                "plain-op worker instead (exact, slower).", RuntimeWarning, stacklevel=3)
    return _state["ok"]


def unavailable_reason() -> str:
    available()
    return _state.get("why", "")


def forward(q, k, v, *, attn_mask=None, is_causal: bool = False, scale: float, dead_rows=None):
    """``(out, lse)`` for ``q (N, Hk, l, D)``, ``k, v (N, Hk, n, ·)``; lse fp32.

    ``dead_rows`` (bool, broadcastable to lse): rows with no visible key, whose lse
    the kernel reports as 0; they are set to -inf. Computed from ``attn_mask`` when not given.
    """
    if q.shape[-2] == 0 or k.shape[-2] == 0:  # torch's kernel divides by zero there (SIGFPE: the process dies)
        return (q.new_zeros(*q.shape[:-1], v.shape[-1]),
                torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device))
    fwd, _ = _ops()
    out, lse = fwd(fit(q), fit(k), fit(v), 0.0, is_causal, attn_mask=fit(attn_mask), scale=scale)
    if attn_mask is not None:
        if dead_rows is None:
            dead_rows = torch.isneginf(attn_mask).all(dim=-1)
        lse = lse.masked_fill(dead_rows, float("-inf"))
    return out, lse


def backward(dout, q, k, v, out, lse, *, attn_mask=None, is_causal: bool = False, scale: float):
    """``(dq, dk, dv)`` given the *global* ``out`` and ``lse`` of the rows (FA2's decomposition).

    A row with lse = -inf must be passed with lse = +inf so the kernel's p = exp(s - lse) is 0.
    """
    if q.shape[-2] == 0 or k.shape[-2] == 0:  # (as forward: no row or no key, nothing flows)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    _, bwd = _ops()
    return bwd(fit(dout), fit(q), fit(k), fit(v), fit(out), fit(lse), 0.0, is_causal,
               attn_mask=fit(attn_mask), scale=scale)


def has_nonfinite(*tensors: torch.Tensor) -> bool:
    """Whether any input holds NaN or inf (torch's kernel would silently output 0 for a row whose scores hold
    them, or let an inf in a hidden key reach a row).

    One reduction per tensor: a NaN or an inf makes the sum NaN or inf (so can a sum of huge finite values
    that overflows, a harmless false positive that only costs the slower, still exact, path)."""
    total: torch.Tensor | float = 0.0
    for t in tensors:
        total = total + t.sum(dtype=torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None)
    return not bool(torch.isfinite(torch.as_tensor(total)))
