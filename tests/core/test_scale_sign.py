"""A scale of 0 or below ("any finite real number", docs/conventions.md). Every kernel hides a key by writing -inf
over its raw score and scales after, so -inf · 0 gave NaN and -inf · (-a) made a hidden key win: ``auto`` answered
NaN wherever a mask cut a tile (the compiled kernel; torch SDPA's own causal path does too). attnkit now rewrites
such a call exactly before any kernel runs (``_request.positive_scale``): ``(q·k)·(-a) = ((-q)·k)·a`` and
``(q·k)·0 = ((q·0)·k)·1``. ``explain`` still shows the call as given."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import EPS

import attnkit
from attnkit import masks as M

L = S = 70


def _ref(q, k, v, scale, allowed):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    w = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return torch.nan_to_num(w) @ v.double()


def _allowed(kind, L=L, S=S):
    i = torch.arange(L)[:, None] + (S - L)
    j = torch.arange(S)[None, :]
    return {"causal": j <= i, "window": (j <= i) & (i - j < 8), "none": torch.ones(L, S, dtype=torch.bool)}[kind]


_MASKS = {
    "causal": ("causal", dict(causal=True)),
    "window": ("window", dict(mask=M.sliding_window(8))),
    "bool tensor": ("window", dict(mask=_allowed("window"))),
    "mask_mod": ("window", dict(mask=lambda b, h, i, j: (j <= i) & (i - j < 8))),
    "none": ("none", dict()),
}


@pytest.mark.parametrize("scale", [0.0, -0.125, -1.0])
@pytest.mark.parametrize("mask", list(_MASKS))
@pytest.mark.parametrize("backend", ["auto", "eager", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scale_of_zero_or_below_is_exact_on_every_backend_forward_and_backward(scale, mask, backend, dtype):
    kind, kw = _MASKS[mask]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, L, 16, generator=g).to(dtype).requires_grad_() for _ in range(3))
    out = attnkit.attention(q, k, v, scale=scale, backend=backend, **kw)
    ref = _ref(q, k, v, scale, _allowed(kind))
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max() <= tol
    grads = torch.autograd.grad(out.double().sum(), (q, k, v))
    want = torch.autograd.grad(_ref(q, k, v, scale, _allowed(kind)).sum(), (q, k, v))
    for got, w in zip(grads, want, strict=True):
        # bf16: a few units of bf16 rounding of the largest gradient (each gradient is rounded to bf16 once, and
        # torch's bf16 kernel -- auto's choice on a CPU that multiplies bf16 -- rounds P and dS to bf16 too); a
        # hidden key that wins, the defect this test is for, is off by the gradient's own size
        gtol = 2e-5 if dtype == torch.float32 else 4 * EPS[torch.bfloat16] * max(1.0, w.abs().max().item())
        assert not got.isnan().any() and (got.double() - w).abs().max() <= gtol
    if scale == 0.0:  # the output does not depend on q
        assert grads[0].abs().max() == 0


def test_the_fast_path_a_decode_step_flex_attention_and_a_compiled_call_take_the_rewrite():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, L, 16, generator=g) for _ in range(3))
    allowed = _allowed("causal")
    for scale in (0.5, 0.5, -0.5, 0.0, -0.5):  # a signature learned at 0.5 is not replayed at -0.5
        torch.testing.assert_close(attnkit.attention(q, k, v, causal=True, scale=scale).double(),
                                   _ref(q, k, v, scale, allowed), rtol=0, atol=2e-6)
    q1 = q[:, :, -1:]
    for scale in (-0.5, 0.0):
        torch.testing.assert_close(attnkit.attention(q1, k, v, mask=M.sliding_window(8), scale=scale).double(),
                                   _ref(q1, k, v, scale, _allowed("window", 1, S)), rtol=0, atol=2e-6)
    bm = attnkit.create_block_mask(lambda b, h, i, j: i >= j, None, None, L, S)
    compiled = torch.compile(lambda q, k, v, s: attnkit.attention(q, k, v, causal=True, scale=s), fullgraph=True)
    for scale in (-0.5, 0.0):
        torch.testing.assert_close(attnkit.flex_attention(q, k, v, block_mask=bm, scale=scale).double(),
                                   _ref(q, k, v, scale, allowed), rtol=0, atol=2e-6)
        torch.testing.assert_close(compiled(q, k, v, scale).double(), _ref(q, k, v, scale, allowed), rtol=0,
                                   atol=2e-6)


def test_explain_shows_a_negative_scale_as_given():
    q = np.array([[1.0, 0], [0, 1]])
    t = attnkit.explain(q, np.array([[1.0, 1], [1, 0]]), np.eye(2), scale=-0.5, causal=True)
    assert t.scale == -0.5 and np.array_equal(t.q, q)
    np.testing.assert_allclose(t.scaled, -0.5 * t.scores)


def test_a_scale_past_float32s_range_is_refused_for_inputs_scored_in_float32():
    """1e39 is a finite Python float but inf in float32, where fp32 / bf16 / fp16 inputs are scored: every output was
    NaN, with no error."""
    q = torch.randn(1, 2, 8, 16)
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match=r"scale: 1e\+39 is past float32's range"):
            attnkit.attention(q.to(dtype), q.to(dtype), q.to(dtype), scale=1e39)
    out = attnkit.attention(q.double(), q.double(), q.double(), scale=1e39)  # float64 scores hold it
    assert torch.isfinite(out).all()
