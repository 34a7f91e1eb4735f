"""backend="tiled" gradients (dq, dk, dv) against the eager path's autograd in float64,
for every mask kind, score_mods (their derivative with respect to the score), GQA/MQA,
block sizes, fully masked rows (zero gradients), gradients through lse, and bf16."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, rand_qkv

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM
from attnkit.backends import tiled


@pytest.fixture(params=[True, False], ids=["fused", "plain"])
def worker(request, monkeypatch):
    monkeypatch.setattr(tiled, "FUSED", request.param)
    return request.param


def _grads(backend, q, k, v, g_out, g_lse=None, blocks=(16, 16), **kw):
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with tiled.block_sizes(*blocks, max(blocks[1], 32)):
        out, lse = attnkit.attention(qq, kk, vv, backend=backend, return_lse=True, **kw)
    loss = (out * g_out).sum()
    if g_lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * g_lse).sum()
    return out, torch.autograd.grad(loss, (qq, kk, vv))


def _check(q, k, v, g_lse=False, blocks=(16, 16), tol=1e-10, **kw):
    g = torch.randn(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    gl = torch.randn(q.shape[:3], dtype=q.dtype) if g_lse else None
    _, got = _grads("tiled", q, k, v, g, gl, blocks, **kw)
    _, want = _grads("eager", q, k, v, g, gl, blocks, **kw)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert not torch.isnan(a).any(), f"d{name}: NaN"
        assert_close(a, b, tol, f"d{name}")


def _docs(S):
    sizes = [S // 4, S // 2, S // 8, S - S // 4 - S // 2 - S // 8]
    return torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))


MASKS = {
    "none": {},
    "causal": {"causal": True},
    "causal_tl": {"mask": M.causal("top_left")},
    "window": {"mask": M.sliding_window(9)},
    "prefix": {"mask": M.prefix_lm(7)},
    "padding": {"mask": M.padding([40, 3])},
    "document": {"mask": M.document(_docs(53)) & M.causal()},
    "from_mod": {"mask": lambda b, h, q, kv: ((q + kv) % 3) != 0},
    "combo": {"mask": ~M.sliding_window(3) & M.causal() | M.prefix_lm(2)},
    "dense_bool": {"mask": torch.rand(2, 1, 41, 53) > 0.3},
    "bias": {"mask": torch.randn(1, 4, 41, 53, dtype=torch.float64)},
}


@pytest.mark.parametrize("name", list(MASKS))
def test_grad_masks(worker, name):
    q, k, v = rand_qkv(2, 4, 2, 41, 53, 16, dtype=torch.float64)
    _check(q, k, v, **MASKS[name])


@pytest.mark.parametrize("mod", ["alibi", "softcap", "relative", "custom"])
def test_grad_score_mods(worker, mod):
    H = 4
    fn = {"alibi": SM.alibi(torch.rand(H, dtype=torch.float64)), "softcap": SM.softcap(1.3),
          "relative": SM.relative_bias(torch.randn(H, 7, dtype=torch.float64)),
          "custom": lambda s, b, h, q, kv: s * torch.sigmoid(s) + 0.01 * (h * (kv - q)).to(s.dtype)}[mod]
    q, k, v = rand_qkv(2, H, 2, 37, 37, 16, dtype=torch.float64, scale=2.0)
    _check(q, k, v, score_mod=fn, causal=True)
    _check(q, k, v, score_mod=fn, mask=M.sliding_window(8))


@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (64, 64)])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_grad_block_sizes_gqa(worker, blocks, H, Hkv):
    q, k, v = rand_qkv(1, H, Hkv, 97, 97, 16, dtype=torch.float64)
    _check(q, k, v, blocks=blocks, mask=M.sliding_window(20))


def test_grad_through_lse(worker):
    q, k, v = rand_qkv(1, 2, 1, 33, 33, 8, dtype=torch.float64)
    _check(q, k, v, g_lse=True, causal=True)
    _check(q, k, v, g_lse=True, score_mod=SM.softcap(2.0))


def test_fully_masked_rows_zero_grad(worker):
    def mod(b, h, q, kv):
        return (q >= 20) & (q != 25) & (kv <= q)

    q, k, v = rand_qkv(1, 2, 2, 40, 40, 8, dtype=torch.float64)
    _check(q, k, v, mask=mod)
    g = torch.randn(1, 2, 40, 8, dtype=torch.float64)
    _, (dq, dk, dv) = _grads("tiled", q, k, v, g, mask=mod)
    assert (dq[:, :, :20] == 0).all() and (dq[:, :, 25] == 0).all()
    _, (dq, dk, dv) = _grads("tiled", q, k, v, g, mask=~M.full())
    assert all((t == 0).all() for t in (dq, dk, dv))


def test_grad_bf16_close_to_fp32(worker):
    q, k, v = rand_qkv(1, 4, 2, 64, 64, 32, dtype=torch.bfloat16)
    g = torch.randn(1, 4, 64, 32)
    _, got = _grads("tiled", q, k, v, g.bfloat16(), blocks=(32, 32), mask=M.sliding_window(20))
    _, want = _grads("eager", q.double(), k.double(), v.double(), g.double(), mask=M.sliding_window(20))
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.dtype == torch.bfloat16
        scale = b.abs().max().item()
        assert_close(a, b, 0.03 * scale, f"d{name} bf16")


def test_score_mod_tensor_grad_flows_on_tiled():
    """Learnable ALiBi slopes: tiled (which auto picks) returns the same gradient as eager."""
    q, k, v = rand_qkv(1, 2, 2, 8, 8, 4, requires_grad=True)
    grads = {}
    for backend in ("tiled", "eager"):
        slopes = torch.tensor([0.5, 0.25], requires_grad=True)
        attnkit.attention(q, k, v, score_mod=SM.alibi(slopes), causal=True, backend=backend).square().sum().backward()
        grads[backend] = slopes.grad
    assert attnkit.dispatch(q, k, v, score_mod=SM.alibi(torch.rand(2, requires_grad=True))).backend == "tiled"
    assert grads["tiled"] is not None and grads["tiled"].abs().sum() > 0
    assert torch.allclose(grads["tiled"], grads["eager"], atol=1e-5)
