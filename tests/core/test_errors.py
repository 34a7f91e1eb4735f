"""Bad inputs: each raises at the boundary, naming the argument, expected, got and the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit
from attnkit import masks


def qkv(B=2, H=4, Hkv=2, L=5, S=7, D=8, Dv=8, dtype=torch.float32):
    return (torch.randn(B, H, L, D, dtype=dtype), torch.randn(B, Hkv, S, D, dtype=dtype),
            torch.randn(B, Hkv, S, Dv, dtype=dtype))


def raises(exc, *needles, **kw):
    q, k, v = kw.pop("qkv", None) or qkv()
    with pytest.raises(exc) as ei:
        attnkit.attention(q, k, v, **kw)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def test_wrong_rank():
    q, k, v = qkv()
    raises(ValueError, "q:", "rank", "(B, H, L, D)", qkv=(q[None], k[None], v[None]))
    raises(ValueError, "same rank", qkv=(q, k[0], v[0]))


def test_heads_not_multiple():
    raises(ValueError, "k:", "divides H=4", "Hkv=3", qkv=qkv(H=4, Hkv=3))


def test_head_dim_mismatch():
    q, k, v = qkv()
    raises(ValueError, "k:", "D=8", "got 6", qkv=(q, k[..., :6], v))


def test_seq_len_mismatch():
    q, k, v = qkv()
    raises(ValueError, "v:", "S=7", "got 6", qkv=(q, k, v[:, :, :6]))


def test_batch_mismatch():
    q, k, v = qkv()
    raises(ValueError, "batch", "B=2", "B=1", qkv=(q, k[:1], v[:1]))


def test_mask_not_broadcastable():
    raises(ValueError, "mask:", "not broadcastable", "(B, H, L, S) = (2, 4, 5, 7)",
           mask=torch.ones(5, 6, dtype=torch.bool))
    raises(ValueError, "mask:", "dim B", mask=torch.ones(3, 1, 5, 7, dtype=torch.bool))
    # a dim the call has once: "expected 1", not "expected 1 or 1"
    with pytest.raises(ValueError, match=r"dim L is 3, expected 1\)") as e:
        attnkit.attention(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 7, 4), torch.randn(1, 1, 7, 4),
                          mask=torch.ones(3, 7, dtype=torch.bool))
    assert "1 or 1" not in str(e.value)


def test_integer_and_mixed_dtypes():
    q, k, v = qkv()
    raises(TypeError, "q:", "floating", "int64", "q.float()", qkv=(q.long(), k, v))
    raises(TypeError, "one dtype", "float64", qkv=(q, k.double(), v))
    raises(TypeError, "mask:", "int64", ".bool()", mask=torch.ones(5, 7, dtype=torch.long))
    raises(TypeError, "mask:", "float64", mask=torch.zeros(5, 7, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype int64"):
        attnkit.attention(np.ones((3, 4), np.int64), np.ones((3, 4)), np.ones((3, 4)))
    with pytest.raises(TypeError, match="all torch tensors or all NumPy"):
        attnkit.attention(q, k.numpy(), v)


def test_numpy_users_get_numpy_fixes():
    """A NumPy bool array as q is refused with NumPy's fix (not torch's ``.float()``); a list with how to make an
    array of it; a bool NumPy mask stays a mask."""
    a = np.random.default_rng(0).standard_normal((5, 8))
    raises(TypeError, "q:", "floating-point array", "got dtype bool", "q.astype(np.float32)", qkv=(a > 0, a, a))
    raises(TypeError, "v:", "got list", "np.asarray(v, dtype=np.float32)", "torch.as_tensor(v)", qkv=(a, a, a.tolist()))
    raises(TypeError, "k:", "got list", "np.asarray(k, dtype=np.float32)", qkv=(a, a.tolist(), a))
    out = attnkit.attention(a, a, a, mask=np.tril(np.ones((5, 5), bool)))
    want = attnkit.attention(a, a, a, causal=True, backend="reference")
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_different_devices():
    q, k, v = qkv()
    raises(ValueError, "one device", "meta", ".to(device)", qkv=(q, k.to("meta"), v))


def test_unknown_backend_and_options():
    raises(ValueError, "backend:", "'flash'", "auto", backend="flash")
    raises(ValueError, "dropout_p", dropout_p=1.5)
    raises(TypeError, "scale", "real number", "'big'", scale="big")
    raises(TypeError, "scale", "float(scale)", "score_mod", scale=torch.tensor(0.3))
    raises(ValueError, "scale", "finite", "inf", scale=float("inf"))
    raises(ValueError, "scale", "finite", "nan", scale=np.float32("nan"))
    raises(TypeError, "score_mod", "5 arguments", "mask_mod", "mask=", "block_mask=create_block_mask(mask_mod, B, H",
           score_mod=lambda b, h, q, kv: q)
    raises(TypeError, "mask_mod", "4 arguments", mask=lambda s, b, h, q, kv: q)
    with pytest.raises(TypeError, match="mask_mod: expected a function of 4 arguments"):  # the same, at from_mod
        masks.from_mod(lambda s, b, h, q, kv: q)
    raises(TypeError, "causal", causal="yes")
    raises(TypeError, "mask:", "got str", mask="causal")


def test_negative_window_and_too_long_lengths():
    with pytest.raises(ValueError, match="size: expected an int >= 1, got -2"):
        masks.sliding_window(-2)
    with pytest.raises(ValueError, match="key_lengths: expected lengths >= 0"):
        masks.padding([3, -1])
    raises(ValueError, "key_lengths", "<= S=7", "truncated", mask=masks.padding([8, 7]))
    raises(ValueError, "key_lengths", "one length per batch row (2)", mask=masks.padding([3]))
    raises(ValueError, "doc_ids", "S=7", mask=masks.document([0, 0, 1]))
    raises(ValueError, "prefix_length", mask=masks.prefix_lm(9))
    q, k, v = qkv(L=9, S=7)
    raises(ValueError, "document mask", "L <= S", "L=9, S=7", qkv=(q, k, v), mask=masks.document([0] * 7))
    with pytest.raises(ValueError, match="align"):
        masks.causal("top")
    with pytest.raises(TypeError, match="key_lengths: expected integers"):
        masks.padding([1.5, 2.0])


def test_cannot_honour_message_names_backend_and_reason():
    """The refusal message says which backend, 'cannot honour', and the specific reason."""
    q, k, v = qkv(D=8, Dv=6)
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot honour.*D == Dv"):
        attnkit.attention(q, k, v, backend="sdpa", return_lse=True)
    with pytest.raises(ValueError, match=r"backend='reference' cannot honour.*dropout"):
        attnkit.attention(q, k, v, backend="reference", dropout_p=0.1)


def test_mask_mod_must_return_bool():
    raises(TypeError, "bool tensor", mask=masks.from_mod(lambda b, h, q, kv: q - kv), backend="reference")


def test_inputs_that_were_quietly_taken_are_refused_by_name():
    """Each was accepted and gave a wrong or surprising answer: a fractional head index picked head 0, integer
    ALiBi slopes were all 0, bool or complex RoPE positions were read as 0 / 1 or their real part, an integer
    KV cache failed only at its first append, and a string flag read as True."""
    from attnkit.nn import KVCache
    from attnkit.positional import RotaryEmbedding, alibi_slopes

    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match=r"return_weights: expected .* query-head indices, got \[0.7\]"):
        attnkit.attention(q, q, q, return_weights=[0.7])
    assert attnkit.attention(q, q, q, return_weights=[torch.tensor(1)])[1].shape == (1, 1, 3, 3)
    with pytest.raises(TypeError, match=r"dtype: expected a floating dtype for the slopes .*got torch.int32"):
        alibi_slopes(4, dtype=torch.int32)
    r, x = RotaryEmbedding(4), torch.randn(1, 2, 3, 4)
    for bad in (torch.tensor([True, False, True]), torch.arange(3) + 0j):
        with pytest.raises(ValueError, match=r"positions: expected an integer tensor of shape \(L,\) = \(3,\)"):
            r.rotate(x, positions=bad)
    with pytest.raises(ValueError, match=r"offset: expected none \(0\) with positions=, got 2.*positions \+ offset"):
        r.rotate(x, 2, positions=torch.arange(3))
    assert torch.equal(r.rotate(x, positions=torch.arange(3) + 2), r.rotate(x, 2))
    for dt in (torch.int32, torch.bool, "float32"):
        with pytest.raises(TypeError, match=r"dtype: expected a floating dtype for keys and values"):
            KVCache(1, 2, 8, 4, dtype=dt)
    c = KVCache(1, 2, 8, 4)
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(TypeError, match=r"owner: expected the calling layer"):
            c.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), owner="x")
        assert c.length == 0  # raised before writing, as append promises
    with pytest.raises(ValueError, match=r"separate_full_blocks: expected a bool .* got 'False'"):
        attnkit.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 8, 8, separate_full_blocks="False")


def test_a_factory_passed_uncalled_is_told_to_call_it():
    """mask=masks.causal (the function, not the mask) was told it might be a score_mod; score_mod=score_mods.alibi
    that it might be a mask_mod. Both now name the call to write."""
    from attnkit import score_mods

    q = torch.randn(1, 1, 3, 4)
    for kw, want in ((dict(mask=masks.causal), r"masks.causal builds one: call it, masks.causal\(\)\."),
                     (dict(mask=masks.sliding_window), r"masks.sliding_window\(size\)"),
                     (dict(mask=masks.Causal), r"masks.Causal is a class: .* masks.causal\(...\)"),
                     (dict(score_mod=score_mods.alibi), r"score_mods.alibi builds one: call it, "
                                                        r"score_mods.alibi\(slopes\)\.")):
        with pytest.raises(TypeError, match=want):
            attnkit.attention(q, q, q, **kw)


@pytest.mark.parametrize("call, message", [
    (lambda: masks.padding("3"), "key_lengths: expected integers .* got str '3'"),
    (lambda: masks.padding(None), "key_lengths: expected integers .* got NoneType None"),
    (lambda: masks.padding([[1, 2], [3]]), "key_lengths: expected integers .* got \\[\\[1, 2\\], \\[3\\]\\]"),
    (lambda: masks.padding(np.int64(3)), "key_lengths: expected 1-D integers, got the single number 3. Pass a list, "
                                     "e.g. \\[3\\]"),
    (lambda: masks.document("abc"), "doc_ids: expected integers .* got str 'abc'"),
    (lambda: masks.document([0, "a"]), "doc_ids: expected integers .* got \\[0, 'a'\\]"),
    (lambda: masks.key_padding("x"), "valid: expected a bool array/tensor \\(B, S\\), got str 'x'"),
])
def test_mask_arguments_of_the_wrong_kind_are_named(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call()


@pytest.mark.parametrize("arg", ["q", "k", "v", "mask"])
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested"])
def test_sparse_and_nested_inputs_are_refused_by_name_also_after_a_learned_dense_call(arg, layout):
    q = torch.randn(1, 2, 4, 8)
    m = torch.ones(4, 4, dtype=torch.bool)
    args = {"q": q, "k": q.clone(), "v": q.clone(), "mask": m}
    attnkit.attention(**args)
    attnkit.attention(**args)  # the fast path has learned this signature
    t = args[arg]
    if layout == "nested":
        if arg == "mask":
            return
        t = torch.nested.nested_tensor([t[0], t[0, :, :3]], layout=torch.jagged)
    elif layout == "sparse_csr":
        if arg != "mask":
            return
        t = t.to_sparse_csr()
    else:
        t = t.to_sparse()
    args[arg] = t
    with pytest.raises(TypeError, match=f"{arg}: expected a dense"):
        attnkit.attention(**args)


_SIZED = {  # each integer argument's call, given the integer n
    "masks.sliding_window": lambda n: masks.sliding_window(n).size,
    "masks.chunked": lambda n: masks.chunked(n).size,
    "masks.prefix_lm": lambda n: masks.prefix_lm(n).prefix_length,
    "positional.alibi_slopes": lambda n: attnkit.positional.alibi_slopes(n).shape[0],
    "positional.RotaryEmbedding": lambda n: attnkit.positional.RotaryEmbedding(n).head_dim,
    "positional.sinusoidal": lambda n: attnkit.positional.sinusoidal(n, 8).shape[0],
    "nn.MultiHeadAttention": lambda n: attnkit.nn.MultiHeadAttention(8 * n, n).num_heads,
    "nn.TransformerBlock": lambda n: attnkit.nn.TransformerBlock(8, 2, mlp_ratio=n).mlp[0].out_features // 8,
    "nn.KVCache": lambda n: attnkit.nn.KVCache(1, 1, n, 4).k.shape[2],
    "plan": lambda n: attnkit.plan(masks.causal(), n).L,
    "tile_mass block": lambda n: attnkit.tile_mass(torch.ones(1, 1, 8, 4), torch.ones(1, 1, 8, 4),
                                                   block=(n, n)).block[0],
    "create_block_mask BLOCK_SIZE": lambda n: attnkit.create_block_mask(lambda b, h, i, j: i >= j, None, None, 8, 8,
                                                                        BLOCK_SIZE=n).BLOCK_SIZE[0],
}


@pytest.mark.parametrize("name", list(_SIZED))
def test_every_integer_argument_takes_numpy_and_tensor_integers_and_refuses_bools_and_floats(name):
    call = _SIZED[name]
    for n in (4, np.int64(4), np.int32(4), torch.tensor(4)):
        got = call(n)
        assert got == 4 and type(got) is int, (n, got)
    for bad in (True, torch.tensor(True), 3.0, np.float64(3.0), "3"):
        with pytest.raises((TypeError, ValueError), match=r"expected (an int|a positive int|\(bm, bn\)|two ints)"):
            call(bad)
