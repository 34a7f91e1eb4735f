"""The GPU path (skipped without CUDA; never a CI dependency): sdpa, flex and the tiled plain
worker on CUDA tensors against the float64 reference, fp32/bf16/fp16, forward and backward."""

from __future__ import annotations

import pytest
import torch
from conftest import EPS

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

L, S, D = 257, 385, 64
CASES = {
    "dense": dict(),
    "causal bottom-right": dict(causal=True),
    "window": dict(mask=M.sliding_window(100)),
    "document": dict(mask=M.document(torch.arange(S) // 97)),
    "prefix": dict(mask=M.prefix_lm(50)),
    "softcap causal": dict(causal=True, score_mod=SM.softcap(20.0)),
    "fully masked rows": dict(mask=M.padding([0, 200])),
}


def _ref(q, k, v, kw):
    up = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    out = attnkit.attention(*up, backend="eager", **kw)
    return up, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex", "tiled"])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_conformance(name, backend, dtype):
    kw = CASES[name]
    torch.manual_seed(0)
    q = torch.randn(2, 4, L, D, device="cuda").to(dtype).requires_grad_()
    k = torch.randn(2, 2, S, D, device="cuda").to(dtype).requires_grad_()
    v = torch.randn(2, 2, S, D, device="cuda").to(dtype).requires_grad_()
    try:
        out = attnkit.attention(q, k, v, backend=backend, **kw)
    except ValueError as e:
        assert backend != "auto" and "cannot honour" in str(e)
        return
    assert out.device.type == "cuda" and out.dtype == dtype and not out.isnan().any()
    up, ref = _ref(q, k, v, kw)
    tol = 4 * EPS[dtype] ** 0.5 if dtype != torch.float32 else 1e-4
    assert (out.double().cpu() - ref).abs().max() <= tol * (1 + ref.abs().max())
    g = torch.randn_like(ref)
    out.backward(g.to(device="cuda", dtype=dtype))
    ref.backward(g)
    for got, want in zip((q, k, v), up, strict=True):
        assert got.grad is not None and not got.grad.isnan().any()
        assert (got.grad.double().cpu() - want.grad).abs().max() <= 10 * tol * (1 + want.grad.abs().max())


def test_cuda_auto_table():
    q = torch.randn(1, 4, 256, 64, device="cuda")
    assert attnkit.dispatch(q, q, q, causal=True).backend == "sdpa"
    assert attnkit.dispatch(q, q, q, mask=M.sliding_window(64)).backend == "flex"
