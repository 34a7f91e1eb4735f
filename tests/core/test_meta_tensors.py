"""Meta tensors (shapes only, no values: a model built under ``torch.device("meta")`` or with ``device="meta"``, run
for its shapes before its weights exist). ``attnkit.attention`` checks the arguments as on any device and answers the
results' shapes, with autograd, from its torch op's fake kernel (``api._on_meta``); it used to reach SDPA's NaN scan
and fail with torch's "Tensor.item() cannot be called on meta tensors". ``MultiHeadAttention`` and
``TransformerBlock`` take torch's factory arguments ``device`` / ``dtype``."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM
from attnkit.nn import MultiHeadAttention, TransformerBlock

B, H, Hkv, L, S, D, Dv = 2, 4, 2, 5, 7, 8, 6
META = torch.device("meta")


def _qkv(rank=4):
    q = torch.empty(B, H, L, D, device=META, requires_grad=True)
    k = torch.empty(B, Hkv, S, D, device=META, requires_grad=True)
    v = torch.empty(B, Hkv, S, Dv, device=META, requires_grad=True)
    if rank == 3:
        q, k, v = (t[0].detach().requires_grad_() for t in (q, k, v))
    elif rank == 2:
        q, k, v = (t[0, 0].detach().requires_grad_() for t in (q, k, v))
    return q, k, v


class _CallableScore:
    def __call__(self, score, b, h, q_idx, kv_idx):
        return score * 2


def _calls():
    bias = torch.zeros(L, S, device=META, requires_grad=True)
    table = torch.zeros(H, S, device=META, requires_grad=True)
    return {
        "none": (dict(), []),
        "causal": (dict(causal=True), []),
        "window": (dict(mask=M.sliding_window(3)), []),
        "bool tensor": (dict(mask=torch.ones(L, S, dtype=torch.bool, device=META)), []),
        "float tensor (grad)": (dict(mask=bias), [bias]),
        "mask_mod": (dict(mask=lambda b, h, i, j: i >= j), []),
        "plan": (dict(mask=attnkit.plan(M.causal(), L, S)), []),
        "BlockMask on meta": (dict(mask=attnkit.create_block_mask(lambda b, h, i, j: i >= j, None, None, L, S,
                                                                  device="meta")), []),
        "score_mod (captured grad)": (dict(score_mod=lambda s, b, h, i, j: s + table[h, j]), [table]),
        "softcap": (dict(score_mod=SM.softcap(5.0)), []),
        "callable score_mod": (dict(score_mod=_CallableScore()), []),
        "sinks": (dict(sinks=torch.zeros(H, device=META)), []),
        "named backend": (dict(backend="eager"), []),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_attention_over_meta_tensors_gives_the_results_shapes_and_gradients(name):
    kw, captured = _calls()[name]
    q, k, v = _qkv()
    out = attnkit.attention(q, k, v, **kw)
    assert out.device == META and out.shape == (B, H, L, Dv) and out.dtype == q.dtype
    out.sum().backward()
    for t in (q, k, v, *captured):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.device == META


@pytest.mark.parametrize("rank", [2, 3, 4])
def test_meta_results_keep_the_callers_rank_and_tuple(rank):
    q, k, v = _qkv(rank)
    lead = {4: (B, H), 3: (H,), 2: ()}[rank]
    out, lse, w = attnkit.attention(q, k, v, return_lse=True, return_weights=True)
    assert out.shape == (*lead, L, Dv) and lse.shape == (*lead, L) and w.shape == (*lead, L, S)
    assert lse.dtype == torch.float32 and all(t.device == META for t in (out, lse, w))
    if rank == 4:
        _, w1 = attnkit.attention(q, k, v, return_weights=[1])
        assert w1.shape == (B, 1, L, S)


def test_meta_arguments_are_checked_as_on_any_device():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="expected one device, got q on meta, k on cpu"):
        attnkit.attention(q, torch.randn(B, Hkv, S, D), v)
    with pytest.raises(ValueError, match="expected head dim D=8"):
        attnkit.attention(q, torch.empty(B, Hkv, S, D + 1, device=META), v)
    with pytest.raises(ValueError, match="return_weights: head indices must be in"):
        attnkit.attention(q, k, v, return_weights=[H])
    bm = attnkit.create_block_mask(lambda b, h, i, j: i >= j, None, None, L, L, device="meta")
    x = torch.randn(1, 2, L, D)
    with pytest.raises(ValueError, match=r"a BlockMask built on the meta device has no blocks to read.*device='cpu'"):
        attnkit.attention(x, x, x, mask=bm)


def test_dispatch_over_meta_tensors_says_no_backend_runs():
    q, k, v = _qkv()
    d = attnkit.dispatch(q, k, v, mask=M.causal())
    assert d.worker == "fake" and "meta tensors" in d.reason and "no backend runs" in d.reason


def test_flex_attention_over_meta_tensors():
    q, k, v = _qkv()
    assert attnkit.flex_attention(q, k, v, enable_gqa=True).shape == (B, H, L, Dv)


@pytest.mark.parametrize("positional", [None, "rope", "alibi"])
def test_modules_take_device_and_dtype_and_run_on_meta(positional):
    m = MultiHeadAttention(32, 4, num_kv_heads=2, positional=positional, device="meta")
    assert all(p.device == META for p in m.parameters())
    x = torch.empty(2, 5, 32, device=META)
    out, w = m(x, causal=True, need_weights=True)
    assert out.shape == (2, 5, 32) and w.shape == (2, 4, 5, 5)
    with torch.device("meta"):
        block = TransformerBlock(32, 4, num_kv_heads=2, positional=positional)
        assert block(torch.empty(2, 5, 32), causal=True).shape == (2, 5, 32)
    m64 = MultiHeadAttention(32, 4, positional=positional, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in m64.parameters())
    assert m64(torch.randn(2, 5, 32, dtype=torch.float64), causal=True).dtype == torch.float64


def test_a_block_built_on_meta_then_materialized_computes_as_the_one_it_loads():
    torch.manual_seed(0)
    ref = TransformerBlock(32, 4, num_kv_heads=2, positional="rope").eval()
    with torch.device("meta"):
        block = TransformerBlock(32, 4, num_kv_heads=2, positional="rope")
    block = block.to_empty(device="cpu").eval()
    block.load_state_dict(ref.state_dict())
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(block(x, causal=True), ref(x, causal=True), rtol=0, atol=0)


def test_factory_arguments_leave_the_default_initialization_unchanged():
    torch.manual_seed(0)
    a = MultiHeadAttention(32, 4)
    torch.manual_seed(0)
    b = MultiHeadAttention(32, 4, device="cpu", dtype=torch.float32)
    for p, r in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, r)
