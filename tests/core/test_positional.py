"""Positional encodings: sinusoidal (the worked d_model = 4 values, corrected), learned, RoPE, ALiBi slopes."""

import math

import pytest
import torch

import attnkit
from attnkit.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_slopes,
    sinusoidal,
)

# ---------------------------------------------------------------- sinusoidal


def test_sinusoidal_seed_003_d_model_4():
    pe = sinusoidal(3, 4, dtype=torch.float64)
    assert pe[1, 0].item() == pytest.approx(math.sin(1.0), abs=1e-15)
    assert pe[1, 1].item() == pytest.approx(math.cos(1.0), abs=1e-15)
    assert pe[1, 2].item() == pytest.approx(math.sin(0.01), abs=1e-15)  # not sin(0.0001) (seed erratum)
    assert pe[1, 2].item() == pytest.approx(0.0100, abs=5e-5)
    assert pe[1, 3].item() == pytest.approx(math.cos(0.01), abs=1e-15)
    assert pe[1, 3].item() == pytest.approx(0.99995, abs=5e-6)
    torch.testing.assert_close(pe[0], torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64))


def test_sinusoidal_module_adds_table_at_offset_and_grows():
    enc = SinusoidalPositionalEncoding(6)
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    table = sinusoidal(20, 6, dtype=torch.float64)
    torch.testing.assert_close(enc(x), x + table[:5], rtol=0, atol=1e-15)
    torch.testing.assert_close(enc(x, offset=15), x + table[15:20], rtol=0, atol=1e-15)  # beyond any initial size
    # decoding one position at a time equals the whole sequence
    steps = torch.cat([enc(x[:, i:i + 1], offset=i) for i in range(5)], 1)
    torch.testing.assert_close(steps, enc(x), rtol=0, atol=0)
    assert "_table" not in enc.state_dict()


def test_learned_embedding_offset_and_limit():
    emb = LearnedPositionalEmbedding(8, 4)
    x = torch.zeros(3, 2, 4)
    torch.testing.assert_close(emb(x, offset=5), emb.weight[5:7].expand(3, 2, 4))
    emb(torch.zeros(1, 8, 4))  # exactly max_length fits
    with pytest.raises(ValueError, match=r"max_length=8.*max_length >= 9"):
        emb(x, offset=7)
    with pytest.raises(ValueError, match="expected shape"):
        emb(torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="offset"):
        emb(x, offset=-1)


# ---------------------------------------------------------------- RoPE


def rope_complex(x, positions, base, interleaved):
    """Independent RoPE: each dimension pair as a complex number times e^{i·p·θ_j}."""
    D = x.shape[-1]
    theta = base ** (-2.0 * torch.arange(D // 2, dtype=torch.float64) / D)
    z = torch.complex(x[..., 0::2], x[..., 1::2]) if interleaved else torch.complex(x[..., : D // 2], x[..., D // 2:])
    ang = positions.to(torch.float64)[:, None] * theta  # (L, D/2)
    r = z * torch.polar(torch.ones_like(ang), ang)
    if interleaved:
        return torch.stack((r.real, r.imag), -1).flatten(-2)
    return torch.cat((r.real, r.imag), -1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("D,L,offset,base", [(2, 1, 0, 10000.0), (16, 17, 0, 10000.0), (64, 9, 1000, 10000.0),
                                             (8, 5, 3, 500.0)])
def test_rope_matches_complex_formulation(interleaved, D, L, offset, base):
    x = torch.randn(2, 3, L, D, dtype=torch.float64)
    rope = RotaryEmbedding(D, base=base, interleaved=interleaved)
    got = rope.rotate(x, offset)
    want = rope_complex(x, torch.arange(offset, offset + L), base, interleaved)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths


def test_rope_rotate_half_and_interleaved_are_permutations_of_each_other():
    D = 8
    x = torch.randn(1, 1, 4, D, dtype=torch.float64)
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # rotate-half pair (i, i + D/2) -> interleaved (2i, 2i+1)
    a = RotaryEmbedding(D).rotate(x, 2)
    b = RotaryEmbedding(D, interleaved=True).rotate(x[..., perm], 2)
    torch.testing.assert_close(a[..., perm], b, rtol=0, atol=1e-14)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_dot_product_depends_only_on_relative_position(interleaved):
    D = 32
    rope = RotaryEmbedding(D, interleaved=interleaved)
    q = torch.randn(1, 1, 1, D, dtype=torch.float64)
    k = torch.randn(1, 1, 1, D, dtype=torch.float64)

    def score(m, n):
        return (rope.rotate(q, m) * rope.rotate(k, n)).sum().item()

    for rel in (0, 1, 5, -3):
        ref = score(10 + rel, 10)
        for shift in (0, 7, 123, 4000):
            assert score(10 + rel + shift, 10 + shift) == pytest.approx(ref, rel=1e-9, abs=1e-9)
    assert score(11, 10) != pytest.approx(score(12, 10), rel=1e-6)  # and it does depend on the offset
    # position 0 is the identity
    torch.testing.assert_close(rope.rotate(q, 0), q)


def test_rope_per_batch_tensor_offset():
    rope = RotaryEmbedding(8)
    x = torch.randn(3, 2, 4, 8, dtype=torch.float64)
    offs = torch.tensor([0, 5, 2])
    got = rope.rotate(x, offs)
    for b in range(3):
        torch.testing.assert_close(got[b:b + 1], rope.rotate(x[b:b + 1], int(offs[b])), rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match=r"offset: a tensor offset must be integer with shape \(B,\)"):
        rope.rotate(x, torch.tensor([0, 1]))


def test_rope_keeps_dtype_and_gradients():
    rope = RotaryEmbedding(16)
    x = torch.randn(1, 2, 3, 16, requires_grad=True)
    y = rope.rotate(x, 4)
    assert y.dtype == torch.float32
    y.square().sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach(), rtol=1e-5, atol=1e-5)  # rotation is orthogonal


def test_rope_bad_inputs():
    with pytest.raises(ValueError, match=r"head_dim: .*even head_dim, got 59.*58 or 60"):
        RotaryEmbedding(59)
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., L, D=8\)"):
        rope.rotate(torch.randn(1, 1, 3, 6))
    with pytest.raises(ValueError, match="offset"):
        rope.rotate(torch.randn(1, 1, 3, 8), -2)
    with pytest.raises(TypeError, match="offset"):
        rope.rotate(torch.randn(1, 1, 3, 8), 1.5)


# ---------------------------------------------------------------- ALiBi


@pytest.mark.parametrize("n,expected", [
    (8, [2.0 ** -k for k in range(1, 9)]),  # 1/2, 1/4, ..., 1/256
    (16, [2.0 ** (-k / 2) for k in range(1, 17)]),  # 2^-0.5, 2^-1, ..., 2^-8
    (6, [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]),  # slopes(4) + slopes(8)[0::2][:2]
    (12, [2.0 ** -k for k in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]),
    (1, [2.0 ** -8]),
])
def test_alibi_slopes_pinned(n, expected):
    got = alibi_slopes(n, dtype=torch.float64)
    assert got.shape == (n,)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)
    assert alibi_slopes(n).dtype == torch.float32


def test_alibi_slopes_with_score_mod_alibi():
    H, L, D = 6, 5, 4
    q, k, v = (torch.randn(1, H, L, D, dtype=torch.float64) for _ in range(3))
    slopes = alibi_slopes(H, dtype=torch.float64)
    out = attnkit.attention(q, k, v, causal=True, score_mod=attnkit.score_mods.alibi(slopes), backend="eager")
    i = torch.arange(L)
    bias = slopes[:, None, None] * (i[None, :] - i[:, None]).double()  # (H, L, S): slope·(j - i)
    s = q @ k.transpose(-1, -2) / math.sqrt(D) + bias
    s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=0, atol=1e-12)


def test_alibi_slopes_bad_input():
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)
    with pytest.raises(TypeError, match="num_heads"):
        alibi_slopes(4.0)


# ---------------------------------------------------------------- dtypes and bad input


def test_learned_embedding_keeps_dtype_never_casts():
    emb = LearnedPositionalEmbedding(8, 4)
    x = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"x: expected torch.float32 .*got torch.bfloat16.*emb.to\(x.dtype\)"):
        emb(x)
    out = emb.to(torch.bfloat16)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, x + emb.weight[:3], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sinusoidal_table_stays_float64_under_module_casts(dtype):
    enc = SinusoidalPositionalEncoding(8).to(dtype)  # .half() / .to(dtype) must not round the table
    x = torch.zeros(1, 40, 8, dtype=dtype)
    y = enc(x, offset=3)
    assert y.dtype == dtype and enc._table.dtype == torch.float64
    # rounded once, float64 -> dtype (not float64 -> fp16 -> ...)
    torch.testing.assert_close(y[0], sinusoidal(43, 8, dtype=torch.float64)[3:].to(dtype), rtol=0, atol=0)
    with pytest.raises(TypeError, match="floating"):
        enc(torch.zeros(1, 2, 8, dtype=torch.int64))


def test_sinusoidal_bad_input_function_and_module_agree():
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"base: expected a finite float > 0"):
            sinusoidal(4, 8, base=bad)
        with pytest.raises(ValueError, match=r"base: expected a finite float > 0"):
            SinusoidalPositionalEncoding(8, base=bad)
    with pytest.raises(TypeError, match="base"):
        sinusoidal(4, 8, base="10000")
    # wrong type -> TypeError, bad value -> ValueError, in the function and in the module
    with pytest.raises(TypeError, match=r"length: expected a positive int, got float"):
        sinusoidal(4.0, 8)
    with pytest.raises(ValueError, match=r"length: expected a positive int, got 0"):
        sinusoidal(0, 8)
    with pytest.raises(TypeError, match=r"embed_dim: expected a positive int, got float"):
        SinusoidalPositionalEncoding(8.0)
    with pytest.raises(ValueError, match=r"embed_dim: expected a positive int, got 0"):
        SinusoidalPositionalEncoding(0)
    with pytest.raises(TypeError, match=r"d_model: expected a positive int"):
        sinusoidal(4, True)
    with pytest.raises(TypeError, match=r"dtype: expected a floating torch\.dtype"):
        sinusoidal(4, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"base: expected a finite float > 1"):
        RotaryEmbedding(8, base=1.0)
    assert not torch.isnan(sinusoidal(4, 8, base=0.5)).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("offset, L", [(0, 1), (255, 1), (3, 7), (300, 2)])
def test_rope_int_offset_fast_path_is_bitwise_the_general_formula(dtype, offset, L):
    """rotate(x, int) (cached [cos, cos] / [-sin, sin] rows, 4 ops) gives exactly the bits of the
    general path (angles from explicit positions, cat of a·cos − b·sin and a·sin + b·cos)."""
    rope = RotaryEmbedding(16)
    x = torch.randn(2, 3, L, 16, dtype=torch.float64).to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
    fast = rope.rotate(x, offset)
    general = rope.rotate(x, positions=torch.arange(offset, offset + L))
    assert fast.dtype == dtype and torch.equal(fast, general)
    ref = rope.rotate(x.double(), positions=torch.arange(offset, offset + L))
    assert (fast.double() - ref).abs().max().item() <= 4 * torch.finfo(dtype).eps * x.double().abs().max().item()
