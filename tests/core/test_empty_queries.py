"""A call with no query rows (L = 0: an empty prompt, a batch's empty slice) answers the empty output on every
path, as torch's SDPA does — never a crash: torch's private CPU flash kernel divides by L (SIGFPE kills the
process), the tile maps divide by it, the decode entry refuses it. Dispatch sends such a call to the eager
path's torch ops (attnkit._dispatch._walk), the compiled op answers it directly (attnkit._op._forward)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks as M

B, H, Hkv, S, D, Dv = 2, 4, 2, 5, 8, 6


def _rel(t):
    def mod(score, b, h, q_idx, kv_idx):
        return score + t[h, kv_idx]

    return mod


def _calls():
    table = torch.randn(H, S, requires_grad=True)
    return {
        "none": dict(),
        "causal": dict(causal=True),
        "window": dict(mask=M.sliding_window(2)),
        "document": dict(mask=M.document(torch.tensor([0, 0, 1, 1, 1]))),
        "key_padding": dict(mask=M.key_padding(torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))),
        "chunked": dict(mask=M.chunked(2)),
        "mask_mod": dict(mask=lambda b, h, q, kv: kv <= q),
        "score_mod": dict(causal=True, score_mod=_rel(table)),
        "bool_tensor": dict(mask=torch.ones(0, S, dtype=torch.bool)),
        "float_tensor": dict(mask=torch.zeros(0, S)),
        "lse": dict(causal=True, return_lse=True),
        "sinks": dict(causal=True, sinks=torch.zeros(H)),
    }


def _qkv(dtype, grad):
    q = torch.randn(B, H, 0, D, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, Hkv, S, D, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, Hkv, S, Dv, dtype=dtype, requires_grad=grad)
    return q, k, v


@pytest.mark.parametrize("backend", ["auto", "eager", "tiled", "sdpa", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_no_query_rows_give_the_empty_output_on_every_path(backend, dtype, grad):
    for name, kw in _calls().items():
        q, k, v = _qkv(dtype, grad)
        got = attnkit.attention(q, k, v, backend=backend, **kw)
        out, lse = got if isinstance(got, tuple) else (got, None)
        assert out.shape == (B, H, 0, Dv) and out.dtype == dtype, (name, out.shape, out.dtype)
        if lse is not None:
            assert lse.shape == (B, H, 0), name
        if grad:
            out.sum().backward()
            assert q.grad is not None and q.grad.shape == q.shape, name
            assert k.grad is not None and not k.grad.any() and v.grad is not None and not v.grad.any(), name


def test_dispatch_says_what_runs():
    q, k, v = _qkv(torch.float32, False)
    d = attnkit.dispatch(q, k, v, causal=True, backend="tiled")
    assert d.backend == "eager" and "L = 0" in d.reason


@pytest.mark.parametrize("name", ["causal", "mask_mod", "score_mod", "lse", "document"])
def test_no_query_rows_under_torch_compile(name):
    torch._dynamo.reset()
    kw = _calls()[name]
    q, k, v = _qkv(torch.float32, True)
    f = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, **kw), backend="aot_eager", fullgraph=True)
    got = f(q, k, v)
    out = got[0] if isinstance(got, tuple) else got
    assert out.shape == (B, H, 0, Dv)
    out.sum().backward()
    assert not k.grad.any() and not v.grad.any() and q.grad.shape == q.shape


@pytest.mark.parametrize("backend", ["auto", "eager", "tiled", "sdpa", "reference"])
def test_no_queries_and_no_keys_give_the_empty_output(backend):
    """Self-attention over an empty sequence (L = S = 0): the empty answer."""
    grad = backend != "reference"
    q = torch.randn(B, H, 0, D, requires_grad=grad)
    k, v = torch.randn(B, Hkv, 0, D, requires_grad=grad), torch.randn(B, Hkv, 0, Dv, requires_grad=grad)
    out, lse = attnkit.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    assert out.shape == (B, H, 0, Dv) and lse.shape == (B, H, 0)
    if grad:
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.parametrize("backend", ["auto", "eager", "tiled", "sdpa", "flex", "reference"])
@pytest.mark.parametrize("name", list(_calls()))
def test_query_rows_over_no_keys_are_fully_masked_rows(backend, name):
    """Query rows over no key (S = 0: cross-attention to an empty memory, a retrieval that found nothing): every
    row is a fully masked row, so the convention for one holds — output 0, lse -inf, zero gradients, never NaN —
    as torch's SDPA answers too (zeros). (A head dimension of 0 is refused by name: no score to take.)"""
    kw = _calls()[name]
    if "mask" in kw and isinstance(kw["mask"], torch.Tensor):
        kw["mask"] = kw["mask"].new_ones(3, 0) if kw["mask"].dtype == torch.bool else kw["mask"].new_zeros(3, 0)
    if name == "score_mod":
        kw["score_mod"] = _rel(torch.randn(H, 0, requires_grad=True))
    if name == "document":  # queries aligned to the last L keys: L <= S, refused by the mask itself, by name
        with pytest.raises(ValueError, match=r"document mask: needs L <= S .*got L=3, S=0"):
            attnkit.attention(torch.randn(B, H, 3, D), torch.randn(B, Hkv, 0, D), torch.randn(B, Hkv, 0, Dv),
                              backend=backend, mask=M.document(torch.zeros(0, dtype=torch.long)))
        return
    if name == "key_padding":
        kw["mask"] = M.key_padding(torch.ones(B, 0, dtype=torch.bool))
    grad = backend != "reference"
    q = torch.randn(B, H, 3, D, requires_grad=grad)
    k, v = torch.randn(B, Hkv, 0, D, requires_grad=grad), torch.randn(B, Hkv, 0, Dv, requires_grad=grad)
    got = attnkit.attention(q, k, v, backend=backend, **kw)
    out, lse = got if isinstance(got, tuple) else (got, None)
    assert out.shape == (B, H, 3, Dv) and not out.isnan().any() and not out.any()
    if lse is not None:  # no key: lse -inf
        assert torch.equal(lse.detach(), torch.full((B, H, 3), -torch.inf))
    if grad:
        (out.sum() + (0 if lse is None else lse.clamp(min=-1e4).sum())).backward()
        assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == k.shape and v.grad.shape == v.shape
    if backend == "auto" and name == "none":  # torch's SDPA gives the same zeros
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)), rtol=0, atol=0)


def test_no_keys_under_torch_compile_fullgraph_and_in_a_decode_loop():
    """S = 0 through the compiled op (fullgraph, with a captured table's gradient, empty) and through the fast
    path's replay of a decode loop that learned its step at S >= 1: zeros, as on the full path."""
    table = torch.randn(H, 0, requires_grad=True)
    mod = _rel(table)
    f = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, mask=M.sliding_window(2), score_mod=mod),
                      fullgraph=True, backend="eager")
    q = torch.randn(B, H, 3, D, requires_grad=True)
    k, v = torch.randn(B, Hkv, 0, D, requires_grad=True), torch.randn(B, Hkv, 0, Dv, requires_grad=True)
    out = f(q, k, v)
    out.sum().backward()
    assert out.shape == (B, H, 3, Dv) and not out.any() and not out.isnan().any()
    assert torch.equal(q.grad, torch.zeros_like(q)) and table.grad is not None and table.grad.shape == (H, 0)
    for S_ in (130, 5, 0, 3, 0):  # one query row over a cache that shrinks to nothing and grows again
        q1 = torch.randn(1, 8, 1, 64)
        k1, v1 = torch.randn(1, 2, S_, 64), torch.randn(1, 2, S_, 64)
        got = attnkit.attention(q1, k1, v1, causal=True)
        want = attnkit.attention(q1.double(), k1.double(), v1.double(), causal=True, backend="reference")
        if S_ == 0:
            assert torch.equal(got, torch.zeros_like(got))
        else:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_head_dimension_of_zero_is_refused_by_name():
    with pytest.raises(ValueError, match=r"q: expected a head dimension D >= 1 .*got D=0"):
        attnkit.attention(torch.randn(B, H, 3, 0), torch.randn(B, Hkv, 4, 0), torch.randn(B, Hkv, 4, Dv))


def test_modules_over_an_empty_sequence():
    from attnkit.nn import MultiHeadAttention, TransformerBlock

    x = torch.randn(2, 0, 16, requires_grad=True)
    for m in (MultiHeadAttention(16, 4), TransformerBlock(16, 4)):
        y = m(x)
        assert y.shape == (2, 0, 16)
        y.sum().backward()
        assert x.grad.shape == x.shape


@pytest.mark.parametrize("backend", ["auto", "eager", "tiled", "sdpa"])
def test_an_empty_batch_with_gradients(backend):
    """B = 0 with query rows: the empty answer and gradients (auto's SDPA fold reshaped with -1 there, the tiled
    engine's tile map reduced over an empty batch)."""
    for mask in (None, torch.ones(0, H, 3, S, dtype=torch.bool)):
        q = torch.randn(0, H, 3, D, requires_grad=True)
        k, v = torch.randn(0, Hkv, S, D, requires_grad=True), torch.randn(0, Hkv, S, Dv, requires_grad=True)
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
        assert out.shape == (0, H, 3, Dv)
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("backend", ["auto", "tiled", "sdpa", "eager", "reference", "flex"])
def test_no_heads_or_no_value_dims_give_the_empty_output_on_every_path(backend):
    """H = 0 (no query heads) killed the process with a division by zero in the compiled kernel; Dv = 0 with a
    segfault in SDPA's NaN scan. Both are the empty output now, with gradients and (for Dv = 0) the lse of float64."""
    q, k, v = torch.randn(B, 0, 3, D, requires_grad=True), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, Dv)
    out, lse = attnkit.attention(q, k, v, backend=backend, return_lse=True)
    assert out.shape == (B, 0, 3, Dv) and lse.shape == (B, 0, 3)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    q, k, v = (torch.randn(B, H, 3, D), torch.randn(B, Hkv, S, D, requires_grad=True), torch.randn(B, Hkv, S, 0))
    out, lse = attnkit.attention(q, k, v, backend=backend, return_lse=True)
    want = attnkit.attention(q.double(), k.detach().double(), v.double(), backend="reference", return_lse=True)[1]
    assert out.shape == (B, H, 3, 0)
    torch.testing.assert_close(lse.double(), want, rtol=1e-5, atol=1e-5)
    assert attnkit.dispatch(q, k, v, backend=backend).backend == "eager"


def test_explain_over_no_keys_is_the_fully_masked_answer():
    """attnkit.explain with S = 0 raised NumPy's "zero-size array to reduction" error; every query row sees no key:
    output 0 and lse -inf, as attention gives."""
    import numpy as np

    q, k, v = np.ones((2, 3)), np.ones((0, 3)), np.ones((0, 4))
    t = attnkit.explain(q, k, v)
    out, lse = attnkit.attention(q, k, v, return_lse=True)
    assert t.weights.shape == (2, 0) and np.array_equal(t.output, out) and np.array_equal(t.lse, lse)
    assert np.all(t.output == 0) and np.all(np.isneginf(t.lse))
