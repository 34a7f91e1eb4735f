"""Grouped-query decoding with the query heads of each K/V head folded into rows (backends/_decode.py).

Every case: attnkit's decode call against the float64 golden with the error budget of
tests/conftest.py, whether the call takes the fast path (``attention``) or the full path
(``backend="sdpa"``; ``auto`` runs a decode step without gradients on the compiled kernel's decode entry),
and ``attnkit.dispatch`` says whether the heads were folded.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import EPS, budget, golden, rand_qkv

import attnkit
from attnkit import masks as M
from attnkit.backends import _decode

B = 2


def _masks(S):
    return {
        "none": None,
        "causal": M.causal(),
        "window": M.sliding_window(5),
        "padding": M.padding([S, max(1, S - 3)]),
        "key_padding": M.key_padding(torch.arange(S).expand(B, S) >= torch.tensor([[0], [min(2, S - 1)]])),
        "chunked": M.chunked(4),
        "window_and_padding": M.sliding_window(6) & M.padding([S, max(1, S - 2)]),
    }


CASES = [(g, L, S, m) for g in (2, 4, 8) for L, S in ((1, 1), (1, 7), (1, 128), (2, 7), (5, 128), (16, 1000), (1, 1000))
         for m in ("none", "causal", "window", "padding", "key_padding", "chunked", "window_and_padding")
         if not (m == "chunked" and L > 1 and S < 8)]


@pytest.mark.parametrize("g,L,S,mname", CASES, ids=[f"g{g}-L{L}-S{S}-{m}" for g, L, S, m in CASES])
def test_folded_decode_matches_float64(g, L, S, mname):
    Hkv, D = 2, 16
    mask = _masks(S)[mname]
    if mask is not None and mask.decode_tile(B, L, S, "cpu") is None:
        pytest.skip("this mask leaves a row with no key at these sizes (the general path handles it)")
    q, k, v = rand_qkv(B, Hkv * g, Hkv, L, S, D)
    ref, _ = golden(q, k, v, mask=mask)
    tol = budget(torch.float32, D, S)
    for backend in ("auto", "sdpa"):
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
        err = (out.double() - ref).abs().max().item()
        assert err <= tol, (backend, err, tol)
    # folded: one query row, or no mask; several rows with a mask over few keys are not (repeating the mask
    # per head costs more than reading K/V again: _decode.FOLD_MASKED_MIN_S)
    folded = "folded into rows" in str(attnkit.dispatch(q, k, v, backend="sdpa", mask=mask))
    assert folded == (mask is None or L == 1), (folded, mname, L, S)


def test_folded_equals_sdpa_with_enable_gqa_bit_for_bit_on_rows():
    """Folding changes which rows share a kernel call, not any row's arithmetic order: the same
    numbers as SDPA with enable_gqa up to the kernel's blocking (checked to the fp32 budget)."""
    q, k, v = rand_qkv(1, 32, 8, 1, 4096, 64)
    ours = attnkit.attention(q, k, v)
    theirs = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert (ours - theirs).abs().max().item() <= budget(torch.float32, 64, 4096)


def test_strided_caches_and_transposed_queries_are_not_copied_wrong():
    """A preallocated cache sliced to the filled length (non-contiguous batch/head strides), a
    (B, L, H, D) query transposed to (B, H, L, D), and K/V in (B, S, Hkv, D) storage."""
    Hkv, g, D, S, cap = 2, 4, 16, 100, 256
    cache_k = torch.randn(B, Hkv, cap, D)
    cache_v = torch.randn(B, Hkv, cap, D)
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]
    q = torch.randn(B, 3, Hkv * g, D).transpose(1, 2)  # L = 3 rows, heads in the middle of the storage
    kt = torch.randn(B, S, Hkv, D).transpose(1, 2)
    vt = torch.randn(B, S, Hkv, D).transpose(1, 2)
    for kk, vv in ((k, v), (kt, vt)):
        for mask in (None, M.causal(), M.sliding_window(9)):
            ref, _ = golden(q, kk, vv, mask=mask)
            out = attnkit.attention(q, kk, vv, mask=mask)
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, D, S)


def test_gradients_through_the_fold_are_exact():
    q, k, v = rand_qkv(B, 8, 2, 3, 50, 16, dtype=torch.float64, requires_grad=True)
    go = torch.randn(B, 8, 3, 16, dtype=torch.float64)
    for mask in (None, M.causal(), M.sliding_window(7)):
        out = attnkit.attention(q, k, v, mask=mask)
        grads = torch.autograd.grad((out * go).sum(), (q, k, v))
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o2 = attnkit.attention(q2, k2, v2, mask=mask, backend="eager")
        ref = torch.autograd.grad((o2 * go).sum(), (q2, k2, v2))
        for a, b in zip(grads, ref, strict=True):
            assert (a - b).abs().max().item() <= 1e-12


def test_bf16_within_the_low_precision_budget():
    q, k, v = rand_qkv(1, 16, 4, 1, 777, 64, dtype=torch.bfloat16)
    ref, _ = golden(q, k, v)
    ours = attnkit.attention(q, k, v)
    theirs = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # what the unfolded path gives
    assert (ours.double() - ref).abs().max() <= 2 * (theirs.double() - ref).abs().max() + 4 * EPS[torch.bfloat16]


def test_nan_propagates_and_dead_rows_are_zero():
    q, k, v = rand_qkv(1, 8, 2, 1, 40, 16)
    k[0, 1, 7, 3] = float("nan")  # kv head 1: its query heads 4-7 see a NaN score
    out = attnkit.attention(q, k, v)
    assert torch.isnan(out[0, 4:]).all() and not torch.isnan(out[0, :4]).any()
    q, k, v = rand_qkv(2, 8, 2, 2, 40, 16)
    out = attnkit.attention(q, k, v, mask=M.padding([40, 0]))  # batch row 1 sees no key
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref, _ = golden(q, k, v, mask=M.padding([40, 0]))
    assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 40)


@pytest.mark.parametrize("why,kw", [
    ("no grouped-query heads", dict(H=4, Hkv=4, L=1)),
    ("L = 17", dict(H=8, Hkv=2, L=17)),
    ("a mask over 64 < 8192 keys for 4 rows", dict(H=8, Hkv=2, L=4, mask=True)),
])
def test_not_folded_where_nothing_is_saved(why, kw):
    q, k, v = rand_qkv(1, kw["H"], kw["Hkv"], kw["L"], 64, 16)
    tile = M.causal().decode_tile(1, kw["L"], 64, "cpu")[2] if kw.get("mask") else None
    assert _decode.foldable(q, k, tile, False).startswith(why)
    assert "folded" not in str(attnkit.dispatch(q, k, v, backend="sdpa", mask=M.causal() if kw.get("mask") else None))


def test_several_rows_with_a_mask_fold_over_many_keys():
    q, k, v = rand_qkv(1, 8, 2, 4, 9000, 16)
    ref, _ = golden(q, k, v, mask=M.causal())
    assert "folded into rows" in str(attnkit.dispatch(q, k, v, backend="sdpa", mask=M.causal()))
    assert (attnkit.attention(q, k, v, mask=M.causal()).double() - ref).abs().max().item() <= budget(
        torch.float32, 16, 9000)


def test_a_mask_that_differs_per_head_is_not_folded_and_is_right():
    q, k, v = rand_qkv(1, 8, 2, 1, 64, 16)
    m = torch.rand(1, 8, 1, 64) > 0.3  # a user bool mask, one per query head
    m[..., 0] = True
    ref, _ = golden(q, k, v, mask=m)
    out = attnkit.attention(q, k, v, mask=m)
    assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 64)
    assert _decode.foldable(q, k, m, False) == "a mask that differs per head"
    assert "folded" not in str(attnkit.dispatch(q, k, v, backend="sdpa", mask=m))


@pytest.mark.parametrize("L", [1, 3])
def test_top_left_causal_is_never_folded(L):
    """SDPA's is_causal (top-left) with one query row lets it see key 0 only: folding the heads into
    rows would move that diagonal (a wrong answer the hypothesis test caught once)."""
    q, k, v = rand_qkv(1, 8, 2, L, 9, 16)
    ref, _ = golden(q, k, v, mask=M.causal("top_left"))
    out = attnkit.attention(q, k, v, mask=M.causal("top_left"))
    assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 9)
