"""Gradients: eager checked numerically (gradcheck, float64); other backends against eager."""

from __future__ import annotations

import pytest
import torch
from conftest import rand_qkv

import attnkit
from attnkit import masks, score_mods

MASKS = {
    "none": None,
    "causal": masks.causal(),
    "window": masks.sliding_window(3),
    "padding": masks.padding([4, 2]),
    "document&causal": masks.document([0, 0, 0, 1, 1, 2]) & masks.causal(),
    "dead_rows": masks.causal("top_left") & masks.from_mod(lambda b, h, q, kv: q >= 2),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_eager_gradcheck(name):
    q, k, v = rand_qkv(2, 4, 2, 6, 6, 5, 3, dtype=torch.float64, requires_grad=True)
    mod = score_mods.softcap(3.0) if name == "window" else None

    def fn(q, k, v):
        return attnkit.attention(q, k, v, mask=MASKS[name], score_mod=mod, backend="eager")

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)


def test_eager_bias_gradient_flows():
    q, k, v = rand_qkv(1, 2, 2, 5, 5, 4, dtype=torch.float64)
    bias = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)

    def fn(b):
        return attnkit.attention(q, k, v, mask=b, backend="eager")

    assert torch.autograd.gradcheck(fn, (bias,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
@pytest.mark.parametrize("name", list(MASKS))
def test_backend_gradients_match_eager(backend, name):
    q, k, v = rand_qkv(2, 4, 2, 6, 6, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    grads = {}
    for be in ("eager", backend):
        out = attnkit.attention(q, k, v, mask=MASKS[name], backend=be)
        grads[be] = torch.autograd.grad(out, (q, k, v), g)
    for a, b, n in zip(grads["eager"], grads[backend], "qkv", strict=True):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-10, msg=f"d{n} {backend} {name}")


@pytest.mark.parametrize("backend", ["eager", "sdpa", "tiled"])
def test_fully_masked_rows_have_zero_gradients(backend):
    q, k, v = rand_qkv(2, 2, 2, 5, 5, 4, dtype=torch.float64, requires_grad=True)
    mask = masks.padding([3, 0])  # batch row 1 sees nothing
    out = attnkit.attention(q, k, v, mask=mask, backend=backend)
    out.sum().backward()
    for t in (q, k, v):
        assert not torch.isnan(t.grad).any()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))
    assert torch.equal(k.grad[1], torch.zeros_like(k.grad[1]))
    assert torch.equal(v.grad[1], torch.zeros_like(v.grad[1]))
    assert torch.equal(k.grad[0, :, 3:], torch.zeros_like(k.grad[0, :, 3:]))  # padded keys get nothing


def test_reference_refuses_autograd():
    q, k, v = rand_qkv(1, 1, 1, 3, 3, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"reference.*autograd"):
        attnkit.attention(q, k, v, backend="reference")
    with torch.no_grad():
        attnkit.attention(q, k, v, backend="reference")


def test_dropout_eager_only_and_scaled():
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16)
    d = attnkit.dispatch(q, k, v, dropout_p=0.5)
    assert d.backend == "eager" and "dropout" in d.reason
    with pytest.raises(ValueError, match=r"reference.*dropout"):
        attnkit.attention(q, k, v, dropout_p=0.5, backend="reference")
    torch.manual_seed(1)
    outs = torch.stack([attnkit.attention(q, k, v, dropout_p=0.5) for _ in range(200)]).mean(0)
    ref = attnkit.attention(q, k, v)
    # inverted dropout is unbiased: the mean over draws approaches the exact output
    assert (outs - ref).abs().mean() < 0.05
