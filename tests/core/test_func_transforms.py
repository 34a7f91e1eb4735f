"""attnkit.attention under torch.func's transforms (grad, vmap, jacrev, per-sample gradients of a module).

A transform's tensors have no memory of their own: the kernels that read memory (the compiled kernel, SDPA's path
with its dead-row scan, the tiled engine, the NumPy reference) cannot run them, so dispatch passes such a call to
the eager path's torch ops, which transforms run (attnkit._dispatch._wrapped). Each answer is checked against the
same computation done without the transform, in float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_close
from torch.func import functional_call, grad, jacrev, vmap

import attnkit
from attnkit import masks as M
from attnkit.nn import MultiHeadAttention

B, H, L, S, D = 1, 2, 5, 40, 8
CALLS = {
    "causal": dict(causal=True),
    "sliding_window": dict(mask=M.sliding_window(8)),
    "mask_mod": dict(mask=lambda b, h, q, kv: kv <= q + 30),
    "score_mod": dict(causal=True, score_mod=lambda s, b, h, q, kv: s * 0.5 + (kv - q) * 0.01),
    "bool_tensor": dict(mask=torch.rand(L, S, generator=torch.Generator().manual_seed(1)) > 0.3),
    "none": dict(),
}


def _qkv(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, n, D, generator=g, dtype=dtype) for n in (L, S, S))


@pytest.mark.parametrize("name", list(CALLS))
def test_grad_equals_autograd(name):
    q, k, v = _qkv()
    kw = CALLS[name]
    got = grad(lambda q: attnkit.attention(q, k, v, **kw).pow(2).sum())(q)
    qq = q.clone().requires_grad_()
    attnkit.attention(qq, k, v, backend="eager", **kw).pow(2).sum().backward()
    assert_close(got, qq.grad, 1e-12, name)


@pytest.mark.parametrize("name", list(CALLS))
def test_vmap_equals_a_loop(name):
    q, k, v = _qkv()
    kw = CALLS[name]
    qs = torch.stack([q, q * 0.5, -q])
    got = vmap(lambda x: attnkit.attention(x, k, v, **kw))(qs)
    want = torch.stack([attnkit.attention(x, k, v, **kw) for x in qs])
    assert_close(got, want, 1e-12, name)


def test_vmap_over_keys_and_values_and_jacrev():
    q, k, v = _qkv()
    ks, vs = torch.stack([k, k.flip(2)]), torch.stack([v, 2 * v])
    got = vmap(lambda k, v: attnkit.attention(q, k, v, causal=True))(ks, vs)
    want = torch.stack([attnkit.attention(q, a, b, causal=True) for a, b in zip(ks, vs, strict=True)])
    assert_close(got, want, 1e-12, "vmap over k, v")
    q1 = q[:, :1, :2]
    jac = jacrev(lambda q: attnkit.attention(q, k[:, :1], v[:, :1], causal=True))(q1)
    want_j = torch.autograd.functional.jacobian(
        lambda q: attnkit.attention(q, k[:, :1], v[:, :1], causal=True, backend="eager"), q1)
    assert_close(jac, want_j, 1e-12, "jacrev")


def test_per_sample_gradients_of_a_module():
    """The classic use: vmap(grad(...)) over a batch through functional_call, against one backward per example."""
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4)
    x = torch.randn(4, 6, 16)
    params = {n: p.detach() for n, p in m.named_parameters()}

    def loss(p, xi):
        out = functional_call(m, p, (xi.unsqueeze(0),))
        return (out[0] if isinstance(out, tuple) else out).pow(2).sum()

    per = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(len(x)):
        mp = {n: p.clone().requires_grad_() for n, p in params.items()}
        loss(mp, x[i]).backward()
        for n in params:
            assert_close(per[n][i], mp[n].grad, 2e-6, f"example {i}, {n}")


def test_a_tensor_the_score_mod_captures_can_be_the_transformed_one():
    """q, k, v plain, the transform over a table the score_mod reads (a learnable relative bias): its gradient,
    and a vmap over tables, as without the transform."""
    q, k, v = _qkv()
    table = torch.randn(H, L + S, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def rel(t):
        return lambda s, b, h, qi, kv: s + t[h, qi - kv + S]

    got = grad(lambda t: attnkit.attention(q, k, v, causal=True, score_mod=rel(t)).pow(2).sum())(table)
    t = table.clone().requires_grad_()
    attnkit.attention(q, k, v, causal=True, score_mod=rel(t), backend="eager").pow(2).sum().backward()
    assert_close(got, t.grad, 1e-12, "grad into the captured table")
    tables = torch.stack([table, 2 * table])
    got = vmap(lambda t: attnkit.attention(q, k, v, causal=True, score_mod=rel(t)))(tables)
    want = torch.stack([attnkit.attention(q, k, v, causal=True, score_mod=rel(x)) for x in tables])
    assert_close(got, want, 1e-12, "vmap over captured tables")


def test_a_named_backend_runs_as_asked():
    """auto picks the eager path under a transform; a backend named explicitly is tried as asked (SDPA's autograd
    runs under grad)."""
    q, k, v = _qkv()
    want = grad(lambda q: attnkit.attention(q, k, v, causal=True, backend="eager").sum())(q)
    for backend in ("sdpa", "auto"):
        got = grad(lambda q, b=backend: attnkit.attention(q, k, v, causal=True, backend=b).sum())(q)
        assert_close(got, want, 1e-12, backend)


def test_a_call_under_a_transform_leaves_the_process_as_it_was():
    """Nothing a transformed call sees is cached as a verdict: torch's flash kernel, probed inside vmap (its
    random probe refused there), is not marked unavailable for the rest of the process."""
    from attnkit.backends import _flash_cpu

    q, k, v = _qkv(torch.float32)
    saved = dict(_flash_cpu._state)
    _flash_cpu._state.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "unavailable" warning either
            vmap(lambda x: attnkit.attention(x, k, v, mask=M.sliding_window(8)))(torch.stack([q, q]))
            vmap(lambda x: (_flash_cpu.available(), x)[1])(torch.stack([q, q]))
        assert "ok" not in _flash_cpu._state or _flash_cpu._state["ok"]
    finally:
        _flash_cpu._state.clear()
        _flash_cpu._state.update(saved)
    assert _flash_cpu.available() == saved.get("ok", _flash_cpu.available())


def test_vmap_with_the_weights_returned():
    q, k, v = _qkv()
    qs = torch.stack([q, -q, 2 * q])
    out, w = vmap(lambda x: attnkit.attention(x, k, v, causal=True, return_weights=True))(qs)
    for i, x in enumerate(qs):
        o1, w1 = attnkit.attention(x, k, v, causal=True, return_weights=True)
        assert_close(out[i], o1, 1e-12, f"out {i}")
        assert_close(w[i], w1, 1e-12, f"weights {i}")


@pytest.mark.parametrize("backend", ["tiled"])
def test_a_named_backend_that_reads_memory_is_refused_under_torch_func_by_name(backend):
    """``backend='tiled'`` under vmap / jacrev raised torch's own errors ("Cannot access data pointer of Tensor that
    doesn't have storage", "must override the setup_context staticmethod"); auto and eager run there."""
    q, k, v = (torch.randn(3, 2, 5, 8) for _ in range(3))
    with pytest.raises(ValueError, match=r"torch\.func transform.*backend='auto' or 'eager'"):
        torch.func.vmap(lambda q, k, v: attnkit.attention(q, k, v, causal=True, backend=backend))(q, k, v)
    with pytest.raises(ValueError, match=r"torch\.func transform"):
        torch.func.jacrev(lambda q: attnkit.attention(q, k[0], v[0], causal=True, backend=backend))(q[0])
    got = torch.func.vmap(lambda q, k, v: attnkit.attention(q, k, v, causal=True))(q, k, v)
    torch.testing.assert_close(got, attnkit.attention(q, k, v, causal=True, backend="eager"), rtol=0, atol=1e-6)
