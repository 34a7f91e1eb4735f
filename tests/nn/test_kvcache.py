"""KV-cache decoding: token-by-token (and prefill + decode) equals the full causal forward;
overflow, batch and layer mismatches raise; a failed call leaves the cache untouched."""

import pytest
import torch

import attnkit
from attnkit.nn import KVCache, MultiHeadAttention, TransformerBlock
from attnkit.positional import RotaryEmbedding

ATOL = 1e-12  # float64 throughout


def decode(layer, x, cache, chunks):
    """Feed ``x (B, L, E)`` through ``layer`` in pieces of the given sizes, with ``cache``."""
    outs, i = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(layer(x[:, i:i + n], kv_cache=cache))
            i += n
    return torch.cat(outs, 1)


POSITIONAL = [None, "rope", RotaryEmbedding(8, interleaved=True), "alibi"]


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("positional", POSITIONAL, ids=["none", "rope", "rope_interleaved", "alibi"])
def test_token_by_token_equals_full_causal(H, Hkv, positional):
    m = MultiHeadAttention(8 * H, H, num_kv_heads=Hkv, positional=positional).double().eval()
    x = torch.randn(2, 9, 8 * H, dtype=torch.float64)
    full = m(x, causal=True)
    cache = m.new_cache(2, 9)
    assert cache.k.shape == (2, Hkv, 9, 8) and cache.k.dtype == torch.float64
    torch.testing.assert_close(decode(m, x, cache, [1] * 9), full, rtol=0, atol=ATOL)
    assert cache.length == 9 and cache.remaining == 0


@pytest.mark.parametrize("chunks", [[5, 1, 1, 1], [3, 4, 1], [8]])
def test_prefill_then_decode(chunks):
    m = MultiHeadAttention(32, 8, num_kv_heads=2, positional="rope").double().eval()
    x = torch.randn(3, 8, 32, dtype=torch.float64)
    cache = m.new_cache(3, 16)  # room to spare
    torch.testing.assert_close(decode(m, x, cache, chunks), m(x, causal=True), rtol=0, atol=ATOL)
    assert cache.length == 8


def test_cached_keys_are_rotated_once():
    m = MultiHeadAttention(16, 2, positional="rope").double()
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    cache = m.new_cache(1, 4)
    decode(m, x, cache, [2, 2])
    k = m.k_proj(x).view(1, 4, 2, 8).transpose(1, 2)
    torch.testing.assert_close(cache.k, m.rotary.rotate(k).detach(), rtol=0, atol=ATOL)


def test_padding_mask_with_cache():
    # batch row 1 has 2 padded prompt positions; the same key mask applies at every step
    m = MultiHeadAttention(16, 4).double().eval()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 1:3] = False
    full = m(x, causal=True, mask=keep[:, None, None, :])
    cache = m.new_cache(2, 6)
    with torch.no_grad():
        outs = [m(x[:, :3], kv_cache=cache, mask=keep[:, None, None, :3])]
        for t in range(3, 6):
            outs.append(m(x[:, t:t + 1], kv_cache=cache, mask=keep[:, None, None, :t + 1]))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=ATOL)


def test_need_weights_with_cache():
    m = MultiHeadAttention(16, 4, num_kv_heads=2).double()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    _, full_w = m(x, causal=True, need_weights=True)
    cache = m.new_cache(1, 5)
    with torch.no_grad():
        m(x[:, :3], kv_cache=cache)
        _, w = m(x[:, 3:4], kv_cache=cache, need_weights=True)
    assert w.shape == (1, 4, 1, 4)
    torch.testing.assert_close(w[0, :, 0], full_w[0, :, 3, :4], rtol=0, atol=ATOL)


def test_stack_of_blocks_decodes_like_full_forward():
    blocks = torch.nn.ModuleList(
        TransformerBlock(16, 4, num_kv_heads=2, causal=True, positional="rope") for _ in range(2)).double().eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)

    def run(h, caches=None):
        for i, blk in enumerate(blocks):
            h = blk(h) if caches is None else blk(h, kv_cache=caches[i])
        return h

    full = run(x)
    caches = [blk.new_cache(2, 7) for blk in blocks]
    with torch.no_grad():
        steps = [run(x[:, :4], caches)] + [run(x[:, t:t + 1], caches) for t in range(4, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=ATOL)


def test_prefill_keeps_gradients():
    m = MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8, requires_grad=True)
    m(x, kv_cache=m.new_cache(1, 4)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


# ---------------------------------------------------------------- bad input


def test_overflow_raises_and_drops_nothing():
    m = MultiHeadAttention(8, 2).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    cache = m.new_cache(1, 4)
    with torch.no_grad():
        m(x[:, :3], kv_cache=cache)
        before = cache.k.clone()
        with pytest.raises(ValueError, match=r"kv_cache: overflow, 3 cached \+ 2 new = 5 tokens > max_length=4.*"
                                             r"max_length >= 5"):
            m(x[:, 3:5], kv_cache=cache)
        assert cache.length == 3 and torch.equal(cache.k, before)
        m(x[:, 3:4], kv_cache=cache)  # what fits still works
        with pytest.raises(ValueError, match="overflow"):
            m(x[:, 4:5], kv_cache=cache)
    assert cache.length == 4


def test_batch_mismatch_raises():
    m = MultiHeadAttention(8, 2)
    cache = m.new_cache(2, 4)
    with pytest.raises(ValueError,
                       match=r"kv_cache: built for batch size 2, got .* batch size 3.*new_cache\(3, max_length\)"):
        m(torch.randn(3, 1, 8), kv_cache=cache)
    assert cache.length == 0


def test_cache_of_another_layer_raises():
    a = MultiHeadAttention(16, 4, num_kv_heads=2)
    b = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match="Each attention layer needs its own cache"):
        b(torch.randn(1, 1, 16), kv_cache=a.new_cache(1, 4))
    with pytest.raises(TypeError, match=r"kv_cache: holds torch.float64"):
        b(torch.randn(1, 1, 16), kv_cache=KVCache(1, 4, 4, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"kv_cache: expected an attnkit\.nn\.KVCache"):
        b(torch.randn(1, 1, 16), kv_cache=(torch.zeros(1), torch.zeros(1)))


def test_cache_is_self_attention_only():
    m = MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match="kv_cache: only for self-attention"):
        m(torch.randn(1, 1, 8), torch.randn(1, 3, 8), kv_cache=m.new_cache(1, 4))


def test_failed_call_leaves_cache_unchanged():
    m = MultiHeadAttention(8, 2)
    cache = m.new_cache(1, 8)
    with torch.no_grad():
        m(torch.randn(1, 2, 8), kv_cache=cache)
        with pytest.raises(ValueError, match="mask"):
            m(torch.randn(1, 1, 8), kv_cache=cache, mask=torch.ones(1, 1, 1, 7, dtype=torch.bool))
    assert cache.length == 2
    cache.reset()
    assert cache.length == 0 and cache.remaining == 8
    assert "length=0" in repr(cache)


def test_new_cache_bad_sizes():
    with pytest.raises(ValueError, match="max_length: expected a positive int"):
        MultiHeadAttention(8, 2).new_cache(1, 0)
    assert isinstance(attnkit.nn.KVCache(1, 1, 2, 4), KVCache)


# ---------------------------------------------------------------- one cache per layer, causal, autograd


def test_one_cache_shared_by_two_blocks_raises():
    blocks = torch.nn.ModuleList(TransformerBlock(16, 4, causal=True) for _ in range(2)).eval()
    shared = blocks[0].new_cache(1, 8)
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        h = blocks[0](x, kv_cache=shared)
        with pytest.raises(ValueError, match=r"kv_cache: each layer needs its own cache: .*MultiHeadAttention.*"
                                             r"new_cache\(batch_size, max_length\) for layer in layers"):
            blocks[1](h, kv_cache=shared)
    assert shared.length == 3  # not 6: the second layer wrote nothing
    with torch.no_grad():
        blocks[0](x[:, :1], kv_cache=shared)  # the owner keeps decoding
    assert shared.length == 4


def test_cache_owner_released_by_reset_and_failed_first_call():
    a, b = MultiHeadAttention(8, 2), MultiHeadAttention(8, 2)
    cache = a.new_cache(1, 8)
    with torch.no_grad():
        with pytest.raises(ValueError, match="mask"):  # a failed first call claims nothing
            a(torch.randn(1, 2, 8), kv_cache=cache, mask=torch.ones(1, 1, 1, 7, dtype=torch.bool))
        b(torch.randn(1, 2, 8), kv_cache=cache)
        with pytest.raises(ValueError, match="each layer needs its own cache"):
            a(torch.randn(1, 1, 8), kv_cache=cache)
        cache.reset()  # an empty cache may serve another layer
        a(torch.randn(1, 2, 8), kv_cache=cache)
    assert cache.length == 2


def test_causal_default_none_and_false_with_cache_raises():
    m = MultiHeadAttention(16, 4).double().eval()
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    # causal=None: not causal without a cache, causal with one
    torch.testing.assert_close(m(x), m(x, causal=False), rtol=0, atol=0)
    assert (m(x) - m(x, causal=True)).abs().max() > 1e-6
    with torch.no_grad():
        torch.testing.assert_close(m(x, kv_cache=m.new_cache(1, 4)), m(x, causal=True), rtol=0, atol=ATOL)
        torch.testing.assert_close(m(x, kv_cache=m.new_cache(1, 4), causal=True), m(x, causal=True),
                                   rtol=0, atol=ATOL)
    cache = m.new_cache(1, 4)
    with pytest.raises(ValueError, match=r"causal=False with a kv_cache: decoding with a cache is causal"):
        m(x, kv_cache=cache, causal=False)
    assert cache.length == 0
    with pytest.raises(TypeError, match="causal: expected True, False or None"):
        m(x, causal=1)
    # the block: default None behaves the same; an explicitly non-causal block refuses a cache
    with pytest.raises(ValueError, match="causal=False with a kv_cache"):
        TransformerBlock(16, 4, causal=False)(torch.randn(1, 2, 16), kv_cache=TransformerBlock(16, 4).new_cache(1, 2))
    blk = TransformerBlock(16, 4).double().eval()
    with torch.no_grad():
        torch.testing.assert_close(blk(x, kv_cache=blk.new_cache(1, 4)), blk(x, causal=True), rtol=0, atol=ATOL)


def test_decoding_with_grad_raises_clearly():
    m = MultiHeadAttention(8, 2).double()
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    cache = m.new_cache(1, 4)
    m(x[:, :3], kv_cache=cache)  # prefill with grad: fine
    with pytest.raises(RuntimeError, match=r"kv_cache: decoding step with autograd recording.*torch.no_grad\(\)"):
        m(x[:, 3:4], kv_cache=cache)
    assert cache.length == 3
    with torch.no_grad():
        m(x[:, 3:4], kv_cache=cache)
    assert cache.length == 4 and not cache.k.requires_grad


def test_prefill_gradient_survives_later_decoding():
    m = MultiHeadAttention(8, 2, positional="rope").double()
    x = torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(m(x, causal=True).square().sum(), x)[0]
    cache = m.new_cache(1, 6)
    out = m(x, kv_cache=cache)  # prefill keeps its graph
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(1, 1, 8, dtype=torch.float64), kv_cache=cache)  # writes into the buffers in place
    got = torch.autograd.grad(out.square().sum(), x)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_kvcache_bad_dims():
    with pytest.raises(ValueError, match=r"value_dim: expected a positive int, got -3"):
        KVCache(1, 1, 4, 8, value_dim=-3)
    with pytest.raises(TypeError, match=r"head_dim: expected a positive int, got float 8.0"):
        KVCache(1, 1, 4, 8.0)
    with pytest.raises(ValueError, match="batch_size"):
        KVCache(0, 1, 4, 8)
    assert KVCache(1, 1, 4, 8, value_dim=3).v.shape == (1, 1, 4, 3)


def test_append_checks_values_too_and_fast_append_equals_checked_append():
    """The decoding append (one expression of checks under no_grad) writes what the checked
    path writes; values of another dtype or head count are refused, never cast or broadcast."""
    c1, c2 = KVCache(2, 2, 8, 4), KVCache(2, 2, 8, 4)
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    with torch.no_grad():
        a = c1.append(k, v)
        a2 = c1.append(k[:, :, :1], v[:, :, :1])
    b = c2.append(k, v)  # grad enabled: the checked path
    b2 = c2.append(k[:, :, :1], v[:, :, :1])
    assert all(torch.equal(x, y) for x, y in zip(a + a2, b + b2, strict=True)) and c1.length == c2.length == 4
    with torch.no_grad():
        with pytest.raises(TypeError, match=r"values of torch.float64"):
            c1.append(k[:, :, :1], v[:, :, :1].double())
        with pytest.raises(ValueError, match=r"kv_cache: holds k \(2, 2, 8, 4\)"):
            c1.append(k[:, :, :1], v[:, :1, :1])  # one value head: would broadcast
        with pytest.raises(ValueError, match=r"kv_cache: holds k \(2, 2, 8, 4\)"):
            c1.append(k[:, :1, :1], v[:, :1, :1])
        with pytest.raises(ValueError, match="overflow"):
            c1.append(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4))
    assert c1.length == 4


def test_append_names_a_wrong_type_or_rank_of_keys():
    c = KVCache(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"expected k of 4 dims \(B, Hkv, L, D\), got shape \(2, 3, 4\).*k\[None\]"):
        c.append(torch.randn(2, 3, 4), torch.randn(2, 3, 4))
    a = torch.zeros(1, 2, 3, 4).numpy()
    with pytest.raises(TypeError, match=r"expected k as a torch.Tensor .* got ndarray.*torch.as_tensor\(k\)"):
        c.append(a, a)
    with pytest.raises(TypeError, match=r"expected v as a torch.Tensor"):
        c.append(torch.zeros(1, 2, 3, 4), a)
    assert c.length == 0


def test_decoding_under_autocast_builds_the_cache_in_autocasts_dtype():
    """Under torch.autocast the projections give bf16 keys: a cache built there is bf16 and decoding
    equals the full causal pass (both in bf16, against float64 within bf16's budget); a cache built
    outside autocast is refused with a message that names autocast, not a moved module."""
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, positional="rope").eval()
    x = torch.randn(2, 7, 32)
    want = m.double()(x.double(), causal=True)
    m.float()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = m(x, causal=True)
        cache = m.new_cache(2, 7)
        assert cache.k.dtype == torch.bfloat16
        got = decode(m, x, cache, [4, 1, 2])
        with pytest.raises(TypeError, match=r"torch.autocast is on.*build the cache inside the autocast block"):
            m(x[:, :1], kv_cache=KVCache(2, 2, 7, 8))
    assert got.dtype == full.dtype == torch.bfloat16
    torch.testing.assert_close(got, full, rtol=0, atol=2 ** -6)
    torch.testing.assert_close(got.double(), want, rtol=2 ** -6, atol=2 ** -6)
    assert m.new_cache(1, 3).k.dtype == torch.float32  # outside autocast: the module's dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m.double().new_cache(1, 3).k.dtype == torch.float64  # float64 is kept, as autocast keeps it


def test_a_cache_whose_first_layer_is_gone_is_refused_to_another_until_reset():
    """The owner check read a dead weak reference as "no owner": after the first layer was garbage-collected any
    number of live layers could append after its keys."""
    import gc

    torch.manual_seed(0)
    first = MultiHeadAttention(8, 2)
    cache = first.new_cache(1, 16)
    x = torch.randn(1, 2, 8)
    with torch.no_grad():
        first(x, kv_cache=cache)
        del first
        gc.collect()
        other = MultiHeadAttention(8, 2)
        with pytest.raises(ValueError, match=r"appended by a module that no longer exists.*cache\.reset"):
            other(x[:, :1], kv_cache=cache)
        assert cache.length == 2
        cache.reset()
        other(x, kv_cache=cache)
        other(x[:, :1], kv_cache=cache)
    assert cache.length == 3
