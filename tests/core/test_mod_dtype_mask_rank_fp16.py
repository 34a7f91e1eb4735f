"""Issue 18, item 5: integer-valued score_mods, 1-D masks, fp16 gradients on tiny causal shapes."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from conftest import fused

import attnkit

BACKENDS = ["eager", "tiled", "auto", "reference"]



# --------------------------------------------------------------------------- integer score_mods
# FlexAttention's own math evaluates torch.where(mask, score_mod(...), -inf in the working
# precision), which promotes an integer score to that float dtype; attnkit casts the same way,
# on every backend. Such a score does not depend on q·k: dq = dk = 0, dv as for any weights.

INT_MODS = {
    "kv-q": lambda s, b, h, q, kv: kv - q,  # indices only: an int64 tile of shape (1, 1, l, n)
    "rounded": lambda s, b, h, q, kv: (s * 4).round().to(torch.int32),
    "bool": lambda s, b, h, q, kv: kv <= q,  # True -> 1.0
}


def _ref_int(q, k, v, mod):
    """Float64 attention over ``mod``'s scores promoted to float64 (no dependence on q, k)."""
    B, H, L, D = q.shape
    S = k.shape[2]
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    idx = [torch.arange(n).view(*[-1 if i == d else 1 for i in range(4)]) for d, n in enumerate((B, H, L, S))]
    s = mod(s, *idx).to(torch.float64).expand(B, H, L, S)
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("on", [True, False], ids=["fused-allowed", "plain"])
@pytest.mark.parametrize("name", list(INT_MODS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_score_mod_is_cast_as_flex_attention_does(backend, name, on):
    mod = INT_MODS[name]
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for n in (5, 7, 7))
    want = _ref_int(q, k, v, mod)
    grad = backend != "reference"
    qq, kk, vv = (t.clone().requires_grad_(grad) for t in (q, k, v))
    with fused(on):
        out = attnkit.attention(qq, kk, vv, score_mod=mod, backend=backend)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    if grad:
        dq, dk, dv = torch.autograd.grad(out.sum(), (qq, kk, vv), allow_unused=True)
        vd = v.clone().requires_grad_()
        want_dv, = torch.autograd.grad(_ref_int(q, k, vd, mod).sum(), vd)
        torch.testing.assert_close(dv, want_dv, rtol=0, atol=1e-12)
        for g in (dq, dk):
            assert g is None or not g.abs().max() > 0, "an integer score has no gradient into q, k"


def test_integer_score_mod_matches_flex_attention_itself():
    flex = pytest.importorskip("torch.nn.attention.flex_attention", reason="compares with FlexAttention (torch >= 2.5)")
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    mod = INT_MODS["kv-q"]
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex_attention without torch.compile warns
            want = flex.flex_attention(q, k, v, score_mod=mod)
        for backend in BACKENDS:
            torch.testing.assert_close(attnkit.attention(q, k, v, score_mod=mod, backend=backend), want,
                                       rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- 1-D masks
# A (S,) mask broadcasts from the right, as NumPy and SDPA's documented "broadcastable to the
# attention weights" rule say (torch's SDPA function itself raises IndexError on it): one row
# of key biases / keep flags shared by every batch row, head and query.


@pytest.mark.parametrize("kind", ["float", "bool"])
@pytest.mark.parametrize("backend", [*BACKENDS, "sdpa"])
def test_1d_mask_broadcasts_over_batch_heads_and_queries(backend, kind):
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (4, 6, 6))
    m = torch.randn(6, dtype=torch.float64) if kind == "float" else torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    want = attnkit.attention(q, k, v, mask=m.view(1, 1, 1, 6), backend="reference")
    torch.testing.assert_close(attnkit.attention(q, k, v, mask=m, backend=backend), want, rtol=0, atol=1e-12)
    if kind == "float" and backend != "reference":  # and its gradient has the mask's own shape
        mg = m.clone().requires_grad_()
        g, = torch.autograd.grad(attnkit.attention(q, k, v, mask=mg, backend=backend).sum(), mg)
        m4 = m.view(1, 1, 1, 6).clone().requires_grad_()
        want_g, = torch.autograd.grad(attnkit.attention(q, k, v, mask=m4, backend="eager").sum(), m4)
        assert g.shape == (6,)
        torch.testing.assert_close(g, want_g.view(6), rtol=0, atol=1e-12)


def test_1d_mask_on_the_fast_path_call():
    """The plain ``attention(q, k, v, mask=bias)`` call (auto's fast path) with a 1-D bias."""
    q, k, v = (torch.randn(1, 2, n, 8) for n in (3, 5, 5))
    m = torch.randn(5)
    want = attnkit.attention(q, k, v, mask=m.view(1, 1, 1, 5), backend="eager")
    torch.testing.assert_close(attnkit.attention(q, k, v, mask=m), want)


def test_1d_mask_of_the_wrong_length_names_the_argument():
    q, k, v = (torch.randn(1, 2, n, 8) for n in (3, 5, 5))
    with pytest.raises(ValueError, match=r"mask: shape \(4,\) is not broadcastable to \(B, H, L, S\)"):
        attnkit.attention(q, k, v, mask=torch.randn(4))


# --------------------------------------------------------------------------- fp16 gradients
# Why fp16 backward exceeded FlashAttention's tolerance (|err| <= 5·|err of PyTorch's fp16 math|
# + 1e-3) on tiny causal shapes: FA2's backward takes delta = rowsum(dO ∘ O) from the output
# *rounded to fp16* (torch's CPU flash backward, used by SDPA and tiled's fused worker, does).
# On a peaked row dp - delta cancels, so O's rounding (2^-11 relative) becomes the gradient's
# error, while PyTorch's math path differentiates its softmax in fp32. On tiny shapes PyTorch's
# own error is small (few elements), so the ratio showed: up to ~40× with |q·k·scale| ~ 9.
# Fixed by keeping the fp32 output for delta (plain worker), running the fp16 kernel in fp32
# (fused worker: also faster on CPUs), and sending fp16 gradients from sdpa/auto there.


def _naive(q, k, v, upcast):
    """PyTorch's math path (FlashAttention's ``attention_ref``): scores in q's dtype, softmax in
    fp32 (float64 for the golden), bottom-right causal, dead rows 0."""
    L, S = q.shape[2], k.shape[2]
    if upcast:
        q, k, v = (t.double() for t in (q, k, v))
    s = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    i, j = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    s = s.masked_fill(~(j <= i + S - L), float("-inf"))
    p = torch.softmax(s if upcast else s.float(), -1).nan_to_num(0.0).to(v.dtype)
    return p @ v


RUNS = {"eager": ("eager", True), "sdpa": ("sdpa", True), "tiled-fused": ("tiled", True),
        "tiled-plain": ("tiled", False), "auto": ("auto", True)}


@pytest.mark.parametrize("run", list(RUNS))
def test_fp16_backward_tiny_causal_within_flash_attention_tolerance(run):
    backend, on = RUNS[run]
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for L, S, D, scale, _ in itertools.product([1, 2, 3, 8], [1, 2, 3, 8], [8, 64], [1.0, 3.0], range(2)):
        q0, k0, v0, g = ((torch.randn(1, 2, n, d, generator=gen) * scale).half()
                         for n, d in ((L, D), (S, D), (S, D), (L, D)))

        def grads(fn, dtype, q0=q0, k0=k0, v0=v0, g=g):
            q, k, v = (t.to(dtype).requires_grad_() for t in (q0, k0, v0))
            out = fn(q, k, v)
            got = torch.autograd.grad(out, (q, k, v), g.to(out.dtype), allow_unused=True)
            return [torch.zeros_like(t, dtype=torch.float64) if x is None else x.double()
                    for x, t in zip(got, (q, k, v), strict=True)]

        ref = grads(lambda q, k, v: _naive(q, k, v, True), torch.float64)
        pt = grads(lambda q, k, v: _naive(q, k, v, False), torch.float16)
        with fused(on):
            got = grads(lambda q, k, v: attnkit.attention(q, k, v, causal=True, backend=backend), torch.float16)
        for name, a, p, r in zip(("dq", "dk", "dv"), got, pt, ref, strict=True):
            tol = 5 * (p - r).abs().max().item() + 1e-3
            err = (a - r).abs().max().item()
            worst = max(worst, err / tol)
            assert err <= tol, (f"{run} {name} L={L} S={S} D={D} scale={scale}: "
                                f"{err:.3g} > 5·{(p - r).abs().max():.3g} + 1e-3")
    assert worst > 0
