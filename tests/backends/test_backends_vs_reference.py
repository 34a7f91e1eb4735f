"""Every backend against the float64 reference over a grid of shapes, masks and score mods."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_close, budget, golden, low_precision_error, rand_qkv

import attnkit
from attnkit import masks, score_mods

BACKENDS = ["eager", "sdpa", "tiled"]

# (B, H, Hkv, L, S, D, Dv): awkward sizes, MHA / GQA / MQA, L != S both ways, Dv != D.
SHAPES = [
    (1, 1, 1, 1, 1, 16, 16),
    (2, 4, 4, 17, 17, 16, 16),
    (1, 4, 2, 97, 129, 59, 59),
    (2, 8, 1, 129, 97, 64, 48),
    (1, 2, 2, 1, 129, 64, 64),
    (1, 6, 3, 33, 33, 111, 111),
]


def _mask_cases(B, L, S):
    lengths = [max(1, S - 3 * b) for b in range(B)]
    ids = torch.arange(S) * 3 // max(S, 1)
    dense = torch.rand(B, 1, L, S) > 0.3
    bias = torch.randn(1, 1, L, S) * 0.5
    return {
        "none": None,
        "causal": masks.causal(),
        "causal_top_left": masks.causal("top_left"),
        "window5": masks.sliding_window(5),
        "padding": masks.padding(lengths),
        "document": masks.document(ids) if L <= S else None,
        "prefix3": masks.prefix_lm(min(3, S)),
        "band_mod": masks.from_mod(lambda b, h, q, kv: (q - kv).abs() <= 4),
        "window|prefix": masks.sliding_window(3) | masks.prefix_lm(min(2, S)),
        "causal&~band": masks.causal() & ~masks.from_mod(lambda b, h, q, kv: (q + S - L - kv) == 1),
        "dense_bool": dense,
        "float_bias": bias,
    }


# The document mask is defined for L <= S only (test_errors checks that L > S raises).
CASES = [(shape, name) for shape in SHAPES for name, m in _mask_cases(shape[0], shape[3], shape[4]).items()
         if not (name == "document" and m is None)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape, mask_name", CASES, ids=[f"{'x'.join(map(str, s))}-{n}" for s, n in CASES])
def test_backend_matches_reference(backend, dtype, shape, mask_name):
    B, H, Hkv, L, S, D, Dv = shape
    mask = _mask_cases(B, L, S)[mask_name]
    q, k, v = rand_qkv(B, H, Hkv, L, S, D, Dv, dtype=dtype)
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        mask = mask.to(dtype)
    ref, ref_lse = golden(q, k, v, mask=mask)
    out, lse = attnkit.attention(q, k, v, mask=mask, backend=backend, return_lse=True) \
        if not (backend == "sdpa" and D != Dv) else (attnkit.attention(q, k, v, mask=mask, backend=backend), None)
    assert out.dtype == dtype and out.shape == (B, H, L, Dv)
    assert_close(out, ref, budget(dtype, D, S), f"{backend} {mask_name}")
    if lse is not None:
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), "lse -inf pattern differs (fully masked rows)"
        assert_close(lse[finite], ref_lse[finite], budget(dtype, D, S) * 4, f"{backend} lse")


SCORE_MODS = {
    "alibi": score_mods.alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "softcap": score_mods.softcap(2.0),
    "relative_bias": score_mods.relative_bias(torch.randn(4, 9)),
    "user_fn": lambda s, b, h, q, kv: s + 0.1 * (h + 1) * torch.cos(q.to(s.dtype) - kv.to(s.dtype)),
}


@pytest.mark.parametrize("backend", ["eager", "tiled"])
@pytest.mark.parametrize("mod_name", list(SCORE_MODS))
@pytest.mark.parametrize("mask", [None, "causal", "window"])
def test_score_mods_match_reference(backend, mod_name, mask):
    q, k, v = rand_qkv(2, 4, 2, 37, 37, 32, dtype=torch.float32)
    m = {None: None, "causal": masks.causal(), "window": masks.sliding_window(7)}[mask]
    ref, _ = golden(q, k, v, mask=m, score_mod=SCORE_MODS[mod_name])
    out = attnkit.attention(q, k, v, mask=m, score_mod=SCORE_MODS[mod_name], backend=backend)
    assert_close(out, ref, budget(torch.float32, 32, 37), f"{backend} {mod_name}")


def test_alibi_reference_by_hand():
    q, k, v = rand_qkv(1, 2, 2, 4, 4, 8, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    t = attnkit.explain(q, k, v, score_mod=score_mods.alibi(slopes), causal=True)
    i, j = np.meshgrid(np.arange(4), np.arange(4), indexing="ij")
    for h in range(2):
        expect = np.where(j <= i, t.scaled[0, h] + slopes[h].item() * (j - i), -np.inf)
        np.testing.assert_allclose(t.masked[0, h], expect)


def test_sdpa_refuses_score_mod():
    q, k, v = rand_qkv(1, 1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"sdpa.*score_mod"):
        attnkit.attention(q, k, v, score_mod=score_mods.softcap(5.0), backend="sdpa")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_budget(backend, dtype):
    q, k, v = rand_qkv(1, 4, 2, 129, 129, 64, dtype=dtype)
    for mask in (None, masks.causal(), masks.sliding_window(16)):
        ref, _ = golden(q, k, v, mask=mask)
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
        assert out.dtype == dtype
        naive = low_precision_error(q, k, v, ref, mask=mask)
        assert_close(out, ref, 2 * naive + 4 * 2 ** -8, f"{backend} {dtype} {mask!r}")


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_numpy_in_numpy_out_and_unbatched_ranks(backend):
    rng = np.random.default_rng(0)
    q2, k2, v2 = rng.standard_normal((5, 8)), rng.standard_normal((7, 8)), rng.standard_normal((7, 8))
    out = attnkit.attention(q2, k2, v2, causal=True, backend=backend)
    assert isinstance(out, np.ndarray) and out.shape == (5, 8) and out.dtype == np.float64
    out, lse = attnkit.attention(q2[None].repeat(3, 0), k2[None].repeat(3, 0), v2[None].repeat(3, 0),
                                 causal=True, backend=backend, return_lse=True)
    assert out.shape == (3, 5, 8) and lse.shape == (3, 5) and isinstance(lse, np.ndarray)
    ref, _ = golden(torch.from_numpy(q2), torch.from_numpy(k2), torch.from_numpy(v2), causal=True)
    np.testing.assert_allclose(out[1], ref.numpy(), atol=1e-12)
    t_out = attnkit.attention(torch.from_numpy(q2).float(), torch.from_numpy(k2).float(),
                              torch.from_numpy(v2).float(), backend=backend)
    assert isinstance(t_out, torch.Tensor) and t_out.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    base = torch.randn(2, 33, 4, 3, 32)  # (B, L, H, 3, D) like a fused qkv projection
    q, k, v = (base[..., i, :].transpose(1, 2) for i in range(3))  # (B, H, L, D) strided views
    assert not q.is_contiguous()
    ref, _ = golden(q, k, v, causal=True)
    assert_close(attnkit.attention(q, k, v, causal=True, backend=backend), ref, budget(torch.float32, 32, 33))


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_fully_masked_rows_are_zero_with_neg_inf_lse(backend):
    q, k, v = rand_qkv(2, 2, 2, 6, 5, 8, dtype=torch.float64)
    allowed = torch.ones(2, 1, 6, 5, dtype=torch.bool)
    allowed[0, :, 2] = False  # one dead row in batch 0
    allowed[1, :, :, :] = False  # a whole dead batch row
    for mask in (allowed, masks.padding([3, 0]), masks.causal("top_left") & masks.from_mod(lambda b, h, q, kv: q >= 1)):
        out, lse = attnkit.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
        ref, ref_lse = golden(q, k, v, mask=mask)
        dead = torch.isneginf(ref_lse)
        assert dead.any()
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert torch.equal(out[dead], torch.zeros_like(out[dead]))
        assert torch.isneginf(lse[dead]).all()
        assert_close(out, ref, 1e-12, backend)


def test_scores_around_1e4_stay_finite():
    q, k, v = rand_qkv(1, 2, 2, 17, 17, 16, dtype=torch.float32)
    q, k = q * 50, k * 50  # |q·k|/√D ~ 1e4
    ref, _ = golden(q, k, v, causal=True)
    assert torch.isfinite(ref).all()
    for backend in BACKENDS:
        out = attnkit.attention(q, k, v, causal=True, backend=backend)
        assert torch.isfinite(out).all(), backend
        assert_close(out, ref, 2e-2, backend)  # near-one-hot rows: error bounded by fp32 score rounding at 1e4


def test_nan_propagates_only_to_affected_rows():
    q, k, v = rand_qkv(1, 1, 1, 4, 4, 8, dtype=torch.float64)
    q[0, 0, 2, 0] = float("nan")
    for backend in ["reference", *BACKENDS]:
        out = attnkit.attention(q, k, v, backend=backend)
        out = torch.as_tensor(out)
        assert torch.isnan(out[0, 0, 2]).all(), backend
        assert not torch.isnan(out[0, 0, [0, 1, 3]]).any(), backend
