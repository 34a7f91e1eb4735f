"""attnkit.nn.MultiHeadAttention / TransformerBlock: torch equivalence, GQA/MQA against an
independent float64 reference, exact weights, dropout, gradients, and every bad input."""

import math

import pytest
import torch

import attnkit
from attnkit.nn import MultiHeadAttention, TransformerBlock
from attnkit.positional import LearnedPositionalEmbedding, RotaryEmbedding, alibi_slopes

TOL = dict(rtol=0, atol=1e-5)  # fp32 against torch's module


def reference_mha(m, query, key=None, value=None, allowed=None, causal=False, bias=None):
    """Independent float64 MHA: explicit projections, repeat_interleave for GQA, plain softmax.

    ``allowed`` (bool, True = attend) and ``bias`` broadcast to (B, H, L, S)."""
    def f(t):
        return t.detach().double()

    key = query if key is None else key
    value = key if value is None else value
    B, L, E = query.shape
    S = key.shape[1]
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim

    def proj(lin, x):
        y = f(x) @ f(lin.weight).T
        return y + f(lin.bias) if lin.bias is not None else y

    q = proj(m.q_proj, query).view(B, L, H, D).transpose(1, 2)
    k = proj(m.k_proj, key).view(B, S, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    v = proj(m.v_proj, value).view(B, S, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, L, S)
    if bias is not None:
        s = s + bias
    if causal:
        i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
        s = s.masked_fill(j > i + S - L, float("-inf"))
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(s, -1)
    o = (w @ v).transpose(1, 2).reshape(B, L, E)
    return proj(m.out_proj, o), w


# ---------------------------------------------------------------- torch.nn.MultiheadAttention


@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_self_attention_with_padding(bias):
    tm = torch.nn.MultiheadAttention(32, 4, bias=bias, batch_first=True).eval()
    m = MultiHeadAttention.from_torch(tm).eval()
    assert (m.embed_dim, m.num_heads, m.num_kv_heads, m.bias) == (32, 4, 4, bias)
    x = torch.randn(3, 7, 32)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    pad[2, 2:] = True  # torch polarity: True = ignore
    ref, ref_w = tm(x, x, x, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
    out, w = m(x, mask=~pad[:, None, None, :], need_weights=True)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(w, ref_w, **TOL)
    torch.testing.assert_close(m(x, mask=~pad[:, None, None, :]), ref, **TOL)
    # the same padding as an attnkit mask object
    torch.testing.assert_close(m(x, mask=attnkit.masks.padding([7, 5, 2])), ref, **TOL)


def test_from_torch_causal_and_attn_mask():
    tm = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    m = MultiHeadAttention.from_torch(tm).eval()
    x = torch.randn(2, 9, 16)
    block = torch.triu(torch.ones(9, 9, dtype=torch.bool), 1)  # torch: True = not allowed
    ref, _ = tm(x, x, x, attn_mask=block, is_causal=True)
    torch.testing.assert_close(m(x, causal=True), ref, **TOL)
    torch.testing.assert_close(m(x, mask=~block), ref, **TOL)
    fbias = torch.randn(9, 9)  # float masks are additive on both sides
    ref_b, _ = tm(x, x, x, attn_mask=fbias)
    torch.testing.assert_close(m(x, mask=fbias), ref_b, **TOL)


@pytest.mark.parametrize("kdim,vdim,bias", [(16, 16, True), (10, 7, True), (12, 12, False), (16, 5, False)])
def test_from_torch_cross_attention(kdim, vdim, bias):
    tm = torch.nn.MultiheadAttention(16, 4, kdim=kdim, vdim=vdim, bias=bias, batch_first=True).eval()
    assert tm._qkv_same_embed_dim == (kdim == vdim == 16)
    m = MultiHeadAttention.from_torch(tm).eval()
    q, k, v = torch.randn(2, 5, 16), torch.randn(2, 11, kdim), torch.randn(2, 11, vdim)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[0, 8:] = True
    ref, ref_w = tm(q, k, v, key_padding_mask=pad, average_attn_weights=False)
    out, w = m(q, k, v, mask=~pad[:, None, None, :], need_weights=True)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(w, ref_w, **TOL)


def test_from_torch_not_batch_first_and_dtype():
    tm = torch.nn.MultiheadAttention(8, 2, batch_first=False).double().eval()
    m = MultiHeadAttention.from_torch(tm)
    assert m.q_proj.weight.dtype == torch.float64 and not m.training
    x = torch.randn(4, 2, 8, dtype=torch.float64)  # (L, B, E): the converted module keeps torch's layout
    ref, _ = tm(x, x, x)
    assert not m.batch_first
    torch.testing.assert_close(m(x), ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(m(x, x, x)[0], ref, rtol=0, atol=1e-12)  # torch's style: torch's tuple


@pytest.mark.parametrize("batch_first", [True, False])
def test_from_torch_takes_torchs_key_padding_mask_exactly(batch_first):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(16, 4, batch_first=batch_first, dtype=torch.float64).eval()
    ours = MultiHeadAttention.from_torch(theirs)
    x = torch.randn(3, 7, 16, dtype=torch.float64)  # (B, L, E)
    if not batch_first:
        x = x.transpose(0, 1)  # (L, B, E)
    pad = torch.zeros(3, 7, dtype=torch.bool)  # (B, S): True = padding (torch's polarity)
    pad[1, 5:] = True
    pad[2, 1:] = True
    ref, _ = theirs(x, x, x, key_padding_mask=pad)
    got, _ = ours(x, x, x, key_padding_mask=pad)  # torch's style of call: torch's tuple
    assert (got - ref).abs().max().item() < 1e-12
    # a float key_padding_mask is added to the scores, as torch does
    bias = torch.randn(3, 7, dtype=torch.float64)
    ref, _ = theirs(x, x, x, key_padding_mask=bias)
    assert (ours(x, key_padding_mask=bias) - ref).abs().max().item() < 1e-12
    # and it is the same as attnkit's own polarity
    assert torch.equal(got, ours(x, mask=~pad[:, None, None, :]))


@pytest.mark.parametrize("batch_first", [True, False])
def test_from_torch_answers_a_torch_style_call_as_torch_does(batch_first):
    """``out, _ = m(x, x, x)`` — torch's idiom — unpacked batch rows 0 and 1 of a bare tensor silently at B = 2.
    A torch-style call (query, key, value positionally) now returns torch's tuple: weights averaged over heads by
    default, per head with average_attn_weights=False, None with need_weights=False; attnkit-style calls keep
    returning the output alone."""
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(16, 4, batch_first=batch_first, dtype=torch.float64).eval()
    ours = MultiHeadAttention.from_torch(theirs)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    if not batch_first:
        x = x.transpose(0, 1)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    for kw in ({}, {"need_weights": False}, {"average_attn_weights": False}, {"key_padding_mask": pad}):
        want_out, want_w = theirs(x, x, x, **kw)
        out, w = ours(x, x, x, **kw)
        assert out.shape == want_out.shape and (out - want_out).abs().max().item() < 1e-12, kw
        if want_w is None:
            assert w is None, kw
        else:
            assert w.shape == want_w.shape and (w - want_w).abs().max().item() < 1e-12, kw
    y = ours(x)  # attnkit's style: the output alone
    assert isinstance(y, torch.Tensor) and torch.equal(y, ours(x, x, x)[0])
    causal, _ = ours(x, x, x, is_causal=True, need_weights=False)
    assert torch.equal(causal, ours(x, causal=True))
    with pytest.raises(TypeError, match=r"attn_mask: .*mask=~attn_mask"):
        ours(x, x, x, attn_mask=torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="not both"):
        ours(x, x, x, is_causal=True, causal=True)


def test_from_torch_key_padding_mask_errors_name_the_argument():
    ours = MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, batch_first=True))
    x = torch.randn(2, 3, 8)
    pad = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"key_padding_mask: pass either .* not both"):
        ours(x, key_padding_mask=pad, mask=~pad[:, None, None, :])
    with pytest.raises(ValueError, match=r"key_padding_mask: expected torch's \(B, S\)"):
        ours(x, key_padding_mask=pad[:, None, None, :])
    with pytest.raises(ValueError, match=r"key_padding_mask: expected a bool .* key_padding_mask\.bool\(\)"):
        ours(x, key_padding_mask=pad.long())


@pytest.mark.parametrize("kdim,vdim,bias", [(None, None, True), (6, 9, True), (None, None, False)])
def test_to_torch_round_trip(kdim, vdim, bias):
    m = MultiHeadAttention(12, 3, kdim=kdim, vdim=vdim, bias=bias).eval()
    tm = m.to_torch()
    assert isinstance(tm, torch.nn.MultiheadAttention) and tm.batch_first and not tm.training
    q = torch.randn(2, 4, 12)
    k = torch.randn(2, 6, kdim or 12)
    v = torch.randn(2, 6, vdim or 12)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 3:] = False  # attnkit polarity: True = attend
    ref, _ = tm(q, k, v, key_padding_mask=~keep)
    torch.testing.assert_close(m(q, k, v, mask=keep[:, None, None, :]), ref, **TOL)
    back = MultiHeadAttention.from_torch(tm)
    for a, b in zip(m.state_dict().values(), back.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_conversion_refusals():
    with pytest.raises(ValueError, match=r"num_kv_heads=2 != num_heads=4"):
        MultiHeadAttention(16, 4, num_kv_heads=2).to_torch()
    with pytest.raises(ValueError, match=r"positional='rope'"):
        MultiHeadAttention(16, 4, positional="rope").to_torch()
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match=r"torch\.nn\.MultiheadAttention"):
        MultiHeadAttention.from_torch(torch.nn.Linear(2, 2))


def test_conversion_docstrings_name_the_polarity():
    for fn in (MultiHeadAttention.from_torch, MultiHeadAttention.to_torch, attnkit.nn.from_torch,
               attnkit.nn.to_torch):
        assert "True = attend" in fn.__doc__ and "True = ignore" in fn.__doc__, fn


# ---------------------------------------------------------------- GQA / MQA, independent reference


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa_against_float64_reference(H, Hkv, causal):
    E = 8 * H
    m = MultiHeadAttention(E, H, num_kv_heads=Hkv).double()
    with torch.no_grad():  # non-zero biases so they are tested too
        for lin in (m.q_proj, m.k_proj, m.v_proj, m.out_proj):
            lin.bias.normal_()
    assert m.k_proj.weight.shape == (Hkv * 8, E) and m.v_proj.weight.shape == (Hkv * 8, E)
    x = torch.randn(2, 13, E, dtype=torch.float64)
    keep = torch.rand(2, 1, 13, 13) > 0.3
    keep[..., 0] = True  # no fully masked rows (the causal diagonal is not guaranteed kept)
    out, w = m(x, mask=keep, causal=causal, need_weights=True)
    ref, ref_w = reference_mha(m, x, allowed=keep, causal=causal)
    assert out.shape == (2, 13, E) and w.shape == (2, H, 13, 13)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-12)
    torch.testing.assert_close(m(x, mask=keep, causal=causal), ref, rtol=0, atol=1e-12)


def test_gqa_cross_attention_against_reference():
    m = MultiHeadAttention(24, 6, num_kv_heads=2, kdim=5, vdim=7).double()
    q, k, v = torch.randn(3, 4, 24).double(), torch.randn(3, 9, 5).double(), torch.randn(3, 9, 7).double()
    ref, _ = reference_mha(m, q, k, v)
    torch.testing.assert_close(m(q, k, v), ref, rtol=0, atol=1e-12)


def test_value_defaults_to_key():
    m = MultiHeadAttention(8, 2).double()
    q, mem = torch.randn(1, 3, 8).double(), torch.randn(1, 5, 8).double()
    torch.testing.assert_close(m(q, mem), m(q, mem, mem), rtol=0, atol=0)


def test_need_weights_exact_and_fully_masked_rows_zero():
    m = MultiHeadAttention(16, 4, num_kv_heads=2)
    x = torch.randn(2, 6, 16)
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[1, 0, 2] = False  # query 2 of batch 1 sees nothing
    out, w = m(x, mask=keep, need_weights=True)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(w[1, :, 2], torch.zeros(4, 6))
    rows = w.sum(-1)
    rows[1, :, 2] += 1
    torch.testing.assert_close(rows, torch.ones(2, 4, 6))
    torch.testing.assert_close(out, m(x, mask=keep), rtol=0, atol=1e-5)


def test_alibi_module_against_reference():
    m = MultiHeadAttention(24, 6, positional="alibi").double()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    i = torch.arange(7)
    bias = alibi_slopes(6, dtype=torch.float64)[:, None, None] * (i[None, :] - i[:, None])
    ref, _ = reference_mha(m, x, causal=True, bias=bias)
    torch.testing.assert_close(m(x, causal=True), ref, rtol=0, atol=1e-12)


def test_rope_module_against_reference():
    m = MultiHeadAttention(16, 2, num_kv_heads=1, positional=RotaryEmbedding(8, interleaved=True)).double()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    # reference: rotate the projected q, k with the independent RotaryEmbedding math, then plain attention
    rope = RotaryEmbedding(8, interleaved=True)
    q = (x @ m.q_proj.weight.T + m.q_proj.bias).view(1, 5, 2, 8).transpose(1, 2)
    k = (x @ m.k_proj.weight.T + m.k_proj.bias).view(1, 5, 1, 8).transpose(1, 2)
    v = (x @ m.v_proj.weight.T + m.v_proj.bias).view(1, 5, 1, 8).transpose(1, 2)
    q, k = rope.rotate(q), rope.rotate(k)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(1, 5, 16)
    torch.testing.assert_close(m(x, causal=True), m.out_proj(o), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- dropout, gradients, block


def test_dropout_only_in_training():
    m = MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 8, 16)
    m.eval()
    a = m(x)
    torch.testing.assert_close(m(x), a, rtol=0, atol=0)
    ref = MultiHeadAttention(16, 4)
    ref.load_state_dict(m.state_dict())
    torch.testing.assert_close(a, ref.eval()(x), rtol=0, atol=1e-6)
    m.train()
    assert (m(x) - a).abs().max() > 1e-3
    _, w = m(x, need_weights=True)  # weights are the exact softmax, before dropout
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 8))


@pytest.mark.parametrize("need_weights", [False, True])
def test_gradients_flow(need_weights):
    m = MultiHeadAttention(16, 4, num_kv_heads=2, positional="rope")
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = m(x, causal=True, need_weights=need_weights)
    out = out[0] if need_weights else out
    out.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_gradcheck_float64():
    m = MultiHeadAttention(8, 2, num_kv_heads=1).double()
    x = torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: m(t, causal=True), (x,))


def test_transformer_block_causal_shapes_and_grads():
    blk = TransformerBlock(16, 4, num_kv_heads=2, causal=True, positional="rope").double()
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    y = blk(x)
    assert y.shape == x.shape
    x2 = x.detach().clone()
    x2[:, 4:] += 1.0  # changing later tokens leaves earlier outputs alone
    torch.testing.assert_close(blk(x2)[:, :4], y[:, :4].detach(), rtol=0, atol=1e-12)
    y.sum().backward()
    assert all(p.grad is not None for p in blk.parameters())
    y, w = blk(x, need_weights=True)
    assert w.shape == (2, 4, 6, 6) and torch.all(w[:, :, 0, 1:] == 0)
    # causal=False at call time overrides the block's default
    assert (blk(x, causal=False)[:, :4] - y[:, :4]).abs().max() > 1e-6


def test_transformer_block_dropout_train_eval():
    blk = TransformerBlock(16, 2, dropout=0.3)
    x = torch.randn(1, 4, 16)
    blk.eval()
    torch.testing.assert_close(blk(x), blk(x), rtol=0, atol=0)
    blk.train()
    assert (blk(x) - blk.eval()(x)).abs().max() > 0


# ---------------------------------------------------------------- bad input


def test_bad_construction():
    with pytest.raises(ValueError,
                       match=r"embed_dim: expected a multiple of num_heads=3.*got 10.*Use embed_dim 9 or 12"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match=r"num_kv_heads: expected a divisor of num_heads=6.*got 4.*\[1, 2, 3, 6\]"):
        MultiHeadAttention(12, 6, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"positional: 'rope' needs an even head dim.*= 59"):
        MultiHeadAttention(59, 1, positional="rope")
    with pytest.raises(ValueError, match=r"head_dim: .*even head_dim, got 59"):
        MultiHeadAttention(59, 1, positional=RotaryEmbedding(59))
    with pytest.raises(ValueError, match=r"RotaryEmbedding\(head_dim=8\) does not match.*RotaryEmbedding\(4\)"):
        MultiHeadAttention(16, 4, positional=RotaryEmbedding(8))
    with pytest.raises(TypeError, match="absolute encoding added to the token embeddings"):
        MultiHeadAttention(16, 4, positional=LearnedPositionalEmbedding(8, 16))
    with pytest.raises(TypeError, match="positional: expected"):
        MultiHeadAttention(16, 4, positional="sinusoidal")
    with pytest.raises(ValueError, match="dropout"):
        MultiHeadAttention(16, 4, dropout=1.0)
    with pytest.raises(TypeError, match="num_heads"):
        MultiHeadAttention(16, 4.0)


def test_bad_call():
    m = MultiHeadAttention(16, 4, kdim=6)
    with pytest.raises(ValueError, match=r"query: expected shape \(B, L, embed_dim=16\).*got \(2, 5, 12\)"):
        m(torch.randn(2, 5, 12), torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"query: .*unsqueeze\(0\)"):
        m(torch.randn(5, 16), torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"key: expected shape \(B, S, kdim=6\)"):
        m(torch.randn(2, 5, 16), torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match=r"key/value: expected batch size 2 \(that of query\), got key 3"):
        m(torch.randn(2, 5, 16), torch.randn(3, 4, 6), torch.randn(3, 4, 16))
    with pytest.raises(ValueError, match=r"value: expected S=4"):
        m(torch.randn(2, 5, 16), torch.randn(2, 4, 6), torch.randn(2, 3, 16))
    with pytest.raises(TypeError, match="key: got value but no key"):
        m(torch.randn(2, 5, 16), value=torch.randn(2, 3, 16))
    with pytest.raises(TypeError, match=r"query: expected torch.float32 .*got torch.float64"):
        m(torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 3, 6, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"query: expected a torch\.Tensor"):
        m([[1.0]])
    r = MultiHeadAttention(16, 4, positional="rope")
    with pytest.raises(ValueError, match="self-attention only"):
        r(torch.randn(1, 2, 16), torch.randn(1, 3, 16))
    with pytest.raises(ValueError, match="mask"):  # attnkit.attention's own validation reaches the user
        MultiHeadAttention(16, 4)(torch.randn(2, 5, 16), mask=torch.ones(2, 5, dtype=torch.bool))


# ---------------------------------------------------------------- torch's calling style, init, mask layout


@pytest.mark.parametrize("positional", [None, "rope", "alibi"])
def test_torch_style_self_attention_call(positional):
    m = MultiHeadAttention(16, 4, positional=positional).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    want = m(x, causal=True)
    torch.testing.assert_close(m(x, x, x, causal=True), want, rtol=0, atol=0)
    torch.testing.assert_close(m(x, x, causal=True), want, rtol=0, atol=0)
    torch.testing.assert_close(m(x, key=x, value=x, causal=True), want, rtol=0, atol=0)
    if positional is not None:  # a different tensor is still cross-attention
        with pytest.raises(ValueError, match="self-attention only"):
            m(x, x.clone(), x)
        with pytest.raises(ValueError, match="self-attention only"):
            m(x, x, x.clone())


def test_init_matches_torch_packed_xavier():
    E = 64
    torch.manual_seed(0)
    m = MultiHeadAttention(E, 4)
    bound = math.sqrt(6 / (E + 3 * E))  # Xavier on torch's packed in_proj_weight (3E, E)
    w = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]).detach()
    assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound
    assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.03)
    tm = torch.nn.MultiheadAttention(E, 4, batch_first=True)
    assert tm.in_proj_weight.std().item() == pytest.approx(w.std().item(), rel=0.03)
    assert all(torch.all(lin.bias == 0) for lin in (m.q_proj, m.k_proj, m.v_proj, m.out_proj))
    # separate kdim / vdim: one Xavier per weight, as torch
    c = MultiHeadAttention(E, 4, kdim=10)
    assert c.k_proj.weight.abs().max() <= math.sqrt(6 / (E + 10))
    assert c.q_proj.weight.abs().max() > math.sqrt(6 / (4 * E))  # (E, E) alone: bound sqrt(6 / 2E)


def test_key_padding_mask_layout():
    m = MultiHeadAttention(16, 4).double()
    B = L = S = 4  # B == L: a (B, S) keep mask fits (L, S) too
    x = torch.randn(B, L, 16, dtype=torch.float64)
    lengths = [4, 3, 2, 1]
    keep = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)
    padded = m(x, mask=keep[:, None, None, :])
    torch.testing.assert_close(padded, m(x, mask=attnkit.masks.padding(lengths)), rtol=0, atol=0)
    # the documented rule: a 2-D mask is (L, S), whatever B is
    as_ls = m(x, mask=keep)
    torch.testing.assert_close(as_ls, m(x, mask=keep[None, None]), rtol=0, atol=0)
    assert (as_ls - padded).abs().max() > 1e-6
    doc = MultiHeadAttention.forward.__doc__
    assert "keep[:, None, None, :]" in doc and "masks.padding(lengths)" in doc and "(L, S)" in doc


def test_a_from_torch_module_answers_torch_style_calls_by_name_and_by_position_as_torch_does():
    """Torch-style calls were recognised only by three positional tensors: ``m(query=x, key=x, value=x)`` returned
    a bare tensor (unpacked as batch rows 0 and 1), ``m(x, x, x, pad, False)`` raised Python's arity error and
    ``attn_mask=None`` was refused."""
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    am = MultiHeadAttention.from_torch(tm)
    x = torch.randn(2, 5, 8)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    calls = {
        "by name": (lambda: am(query=x, key=x, value=x, key_padding_mask=pad), {}),
        "mixed": (lambda: am(x, x, value=x, key_padding_mask=pad), {}),
        "positional": (lambda: am(x, x, x, pad), {}),
        "positional need_weights": (lambda: am(x, x, x, pad, False), dict(need_weights=False)),
        "positional average": (lambda: am(x, x, x, pad, True, None, False), dict(average_attn_weights=False)),
        "attn_mask=None": (lambda: am(x, x, x, key_padding_mask=pad, attn_mask=None), {}),
    }
    for name, (call, kw) in calls.items():
        got, want = call(), tm(x, x, x, key_padding_mask=pad, **kw)
        assert isinstance(got, tuple) and len(got) == 2, name
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
        assert (got[1] is None) == (want[1] is None), name
        if want[1] is not None:
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match="at most 8 positional arguments"):
        am(x, x, x, pad, True, None, True, False, 1)
    assert isinstance(am(x), torch.Tensor)  # attnkit's style: out alone


def test_a_sequence_first_module_names_its_own_layout_in_input_errors():
    am = MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2))
    with pytest.raises(ValueError, match=r"\(L, B, embed_dim=8\) \(batch_first=False\), got \(5, 8\)\. Fix: add a "
                                         r"batch dim with x\.unsqueeze\(1\)"):
        am(torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"got \(5, 2, 9\)\. Fix: project it to embed_dim=8"):
        am(torch.randn(5, 2, 9))


def test_alibi_slopes_stay_float32_when_the_module_is_cast():
    m = MultiHeadAttention(64, 16, positional="alibi")
    want = m.alibi_slopes.clone()
    for cast in (m.bfloat16, m.half, m.double, m.float):
        cast()
        assert m.alibi_slopes.dtype == torch.float32 and torch.equal(m.alibi_slopes, want)


def test_requires_grad_carries_across_from_torch_and_to_torch():
    for kdim in (None, 6):
        tm = torch.nn.MultiheadAttention(8, 2, kdim=kdim, vdim=kdim, batch_first=True)
        for p in tm.parameters():
            p.requires_grad_(False)
        tm.out_proj.weight.requires_grad_(True)
        am = MultiHeadAttention.from_torch(tm)
        assert [n for n, p in am.named_parameters() if p.requires_grad] == ["out_proj.weight"]
        back = am.to_torch()
        assert [n for n, p in back.named_parameters() if p.requires_grad] == ["out_proj.weight"]
    am = MultiHeadAttention(8, 2)
    am.k_proj.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="differ in requires_grad"):
        am.to_torch()
