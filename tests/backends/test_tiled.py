"""backend="tiled" forward against the float64 golden: every mask kind, combinations,
mask_mods, score_mods, awkward lengths, several block sizes, GQA/MQA, L != S, fp32/bf16,
fully masked rows and tiles, and both workers (fused kernel per run / plain-op loop)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, budget, fused, golden, rand_qkv

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM
from attnkit.backends import _worklist as _blocks
from attnkit.backends import tiled

BLOCKS = [(16, 16), (32, 16), (64, 64)]


@pytest.fixture(params=["native", "fused", "plain"])
def worker(request, monkeypatch):
    """Each test runs on the compiled kernel (where the call fits it), torch's flash kernel per run,
    and plain torch ops."""
    monkeypatch.setattr(tiled, "FUSED", request.param != "plain")
    monkeypatch.setattr(tiled, "NATIVE", request.param == "native")
    return request.param


def _docs(S):
    sizes = [S // 5, S // 3, S - S // 5 - S // 3]
    return torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))


def _mask_cases(L, S):
    """(id, kwargs) pairs valid for L, S."""
    cases = [
        ("none", {}),
        ("causal", {"causal": True}),
        ("causal_tl", {"mask": M.causal("top_left")}),
        ("window7", {"mask": M.sliding_window(7)}),
        ("window7_tl", {"mask": M.sliding_window(7, "top_left")}),
        ("prefix", {"mask": M.prefix_lm(min(S, 11))}),
        ("padding", {"mask": M.padding([S, max(S - 13, 0)])}),
        ("band_mod", {"mask": lambda b, h, q, kv: (q - kv).abs() <= 5}),
        ("head_mod", {"mask": M.from_mod(lambda b, h, q, kv: (kv % (h + 2)) == 0)}),
        ("or_not", {"mask": ~M.causal() | M.sliding_window(4)}),
        ("and_pad", {"mask": M.causal() & M.padding([S, S // 2 + 1])}),
        ("dense_bool", {"mask": torch.rand(1, 4, L, S) > 0.6}),
        ("bias", {"mask": torch.randn(2, 1, L, S, dtype=torch.float64)}),
        ("causal_bias", {"causal": True, "mask": torch.randn(1, 1, L, S, dtype=torch.float64)}),
    ]
    if L <= S:
        cases.append(("doc_causal", {"mask": M.document(_docs(S)) & M.causal()}))
    return cases


def _run(dtype, L, S, kw, H=4, Hkv=2, D=16, blocks=(16, 16)):
    q, k, v = rand_qkv(2, H, Hkv, L, S, D, dtype=dtype)
    kw = dict(kw)
    if isinstance(kw.get("mask"), torch.Tensor) and kw["mask"].is_floating_point():
        kw["mask"] = kw["mask"].to(dtype if dtype != torch.bfloat16 else torch.float32)
    with tiled.block_sizes(*blocks, max(blocks[1], 32)):
        out, lse = attnkit.attention(q, k, v, backend="tiled", return_lse=True, **kw)
    ref, ref_lse = golden(q, k, v, **kw)
    return out, lse, ref, ref_lse, D


# Only the cases defined for each (L, S): the document mask needs L <= S (its
# queries are the last L key positions), and test_errors checks that L > S raises.
_EXACT = [(L, S, i) for L, S in [(97, 97), (17, 129), (129, 17), (1, 97)] for i in range(len(_mask_cases(L, S)))]


@pytest.mark.parametrize("L,S,case", _EXACT)
def test_masks_fp64_exact(worker, L, S, case):
    name, kw = _mask_cases(L, S)[case]
    out, lse, ref, ref_lse, D = _run(torch.float64, L, S, kw)
    assert_close(out, ref, budget(torch.float64, D, S), name)
    _assert_lse(lse, ref_lse, budget(torch.float64, D, S), name)


def _assert_lse(lse, ref_lse, tol, what):
    """lse equals the golden's: the same -inf rows (fully masked), the finite ones within ``tol``."""
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{what}: -inf lse pattern"
    fin = torch.isfinite(ref_lse)
    assert_close(lse[fin], ref_lse[fin], tol, f"{what} lse")


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("L", [1, 17, 97, 129])
@pytest.mark.parametrize("name", ["causal", "window7", "doc_causal", "band_mod", "dense_bool"])
def test_block_sizes_fp32(worker, blocks, L, name):
    kw = dict(_mask_cases(L, L))[name]
    out, lse, ref, ref_lse, D = _run(torch.float32, L, L, kw, blocks=blocks)
    assert_close(out, ref, budget(torch.float32, D, L), f"{name} {blocks}")
    _assert_lse(lse, ref_lse, budget(torch.float32, D, L), f"{name} {blocks}")


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"causal": True}, {"mask": M.sliding_window(100)}], ids=["causal", "window"])
def test_length_1025(worker, kw):
    out, lse, ref, ref_lse, D = _run(torch.float32, 1025, 1025, kw, H=2, Hkv=1, blocks=(64, 64))
    assert_close(out, ref, budget(torch.float32, D, 1025), "1025")
    _assert_lse(lse, ref_lse, budget(torch.float32, D, 1025), "1025")


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("D,Dv", [(16, 16), (59, 23)])
def test_gqa_mqa_and_head_dims(worker, H, Hkv, D, Dv):
    q, k, v = rand_qkv(2, H, Hkv, 45, 70, D, Dv=Dv)
    kw = {"mask": M.sliding_window(9) | M.prefix_lm(3)}
    with tiled.block_sizes(16, 16):
        out = attnkit.attention(q, k, v, backend="tiled", **kw)
    ref, _ = golden(q, k, v, **kw)
    assert_close(out, ref, budget(torch.float32, D, 70), "gqa")


@pytest.mark.parametrize("mod", ["alibi", "softcap", "relative", "custom"])
@pytest.mark.parametrize("L,S", [(97, 97), (33, 80)])
def test_score_mods(worker, mod, L, S):
    H = 4
    fn = {"alibi": SM.alibi(torch.rand(H)), "softcap": SM.softcap(1.5),
          "relative": SM.relative_bias(torch.randn(H, 9)),
          "custom": lambda s, b, h, q, kv: s * torch.sigmoid(s) + 0.01 * (h * (kv - q)).to(s.dtype)}[mod]
    for kw in ({"score_mod": fn}, {"score_mod": fn, "causal": True}, {"score_mod": fn, "mask": M.sliding_window(10)}):
        out, lse, ref, ref_lse, D = _run(torch.float64, L, S, kw)
        assert_close(out, ref, budget(torch.float64, D, S), mod)
        _assert_lse(lse, ref_lse, budget(torch.float64, D, S), f"{mod} {sorted(kw)}")


def test_fully_masked_rows_and_tiles(worker):
    # rows 0..39 see nothing (all their tiles empty); row 50 sees nothing inside a partial tile
    def mod(b, h, q, kv):
        return (q >= 40) & (q != 50) & (kv <= q)

    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16)
    with tiled.block_sizes(16, 16):
        out, lse = attnkit.attention(q, k, v, mask=mod, backend="tiled", return_lse=True)
    assert not torch.isnan(out).any()
    assert (out[:, :, :40] == 0).all() and (out[:, :, 50] == 0).all()
    assert torch.isneginf(lse[:, :, :40]).all() and torch.isneginf(lse[:, :, 50]).all()
    assert torch.isfinite(lse[:, :, 41:50]).all()
    # everything masked
    out, lse = attnkit.attention(q, k, v, mask=~M.full(), backend="tiled", return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_empty_query_blocks_are_skipped():
    p = _blocks.work_list(M.sliding_window(16), None, 1, 2, 256, 256, 32, 32, 256)
    assert p.density == 15 / 64  # the diagonal tile and the one before it, per query block
    # no group reaches keys more than one block behind its rows
    for i0, i1, runs in p.groups:
        for j0, j1, _spans in runs:
            assert j0 >= i0 - 32 and j1 <= i1


def test_grids_match_dense_definition():
    L, S, bm, bn = 70, 90, 16, 8
    ids = torch.tensor(sorted(torch.randint(0, 6, (S,)).tolist()))
    for mask in [M.causal(), M.causal("top_left"), M.sliding_window(13), M.prefix_lm(20), M.padding([33, 90]),
                 M.document(ids), M.causal() & ~M.sliding_window(5), M.sliding_window(9) | M.prefix_lm(4)]:
        grid = _blocks.tile_map(mask, 2, 1, L, S, bm, bn)
        dense = mask.materialize(2, 1, L, S)
        for qi in range(grid.shape[0]):
            for kj in range(grid.shape[1]):
                t = dense[..., qi * bm:(qi + 1) * bm, kj * bn:(kj + 1) * bn]
                g = int(grid[qi, kj])
                if g == _blocks.EMPTY:
                    assert not t.any(), (mask, qi, kj)
                if g == _blocks.FULL:
                    assert t.all(), (mask, qi, kj)
                if mask.__class__ in (M.Causal, M.SlidingWindow, M.PrefixLM):  # closed form is tight
                    assert g == (_blocks.FULL if t.all() else _blocks.EMPTY if not t.any() else _blocks.PARTIAL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"mask": M.sliding_window(33)}],
                         ids=["dense", "causal", "window"])
def test_low_precision_within_sdpa_error(worker, dtype, kw):
    """bf16/fp16: error vs float64 at most 2x that of torch SDPA in the same dtype (+ a few ulps)."""
    q, k, v = rand_qkv(1, 4, 4, 200, 200, 64, dtype=dtype)
    ref, _ = golden(q, k, v, **kw)
    with tiled.block_sizes(64, 64):
        out = attnkit.attention(q, k, v, backend="tiled", **kw)
    m = M.sliding_window(33).materialize(1, 1, 200, 200) if "mask" in kw else None
    sd = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=bool(kw.get("causal")))
    sdpa_err = (sd.double() - ref).abs().max().item()
    assert out.dtype == dtype
    assert_close(out, ref, 2 * sdpa_err + 4 * 2 ** -8 * 0.01, f"{dtype}")


def test_lse_dtype_and_noncontiguous(worker):
    q, k, v = rand_qkv(1, 4, 2, 40, 50, 16, dtype=torch.bfloat16)
    _, lse = attnkit.attention(q, k, v, backend="tiled", return_lse=True, causal=True)
    assert lse.dtype == torch.float32
    # non-contiguous: (B, L, H, D) storage viewed as (B, H, L, D)
    qn = torch.randn(1, 40, 4, 16).transpose(1, 2)
    kn = torch.randn(1, 50, 2, 16).transpose(1, 2)
    vn = torch.randn(1, 50, 2, 16).transpose(1, 2)
    out = attnkit.attention(qn, kn, vn, backend="tiled", causal=True)
    ref, _ = golden(qn, kn, vn, causal=True)
    assert_close(out, ref, budget(torch.float32, 16, 50), "non-contiguous")


def test_unbatched_and_numpy():
    q, k, v = rand_qkv(1, 1, 1, 9, 9, 8)
    out = attnkit.attention(q[0, 0].numpy(), k[0, 0].numpy(), v[0, 0].numpy(), causal=True, backend="tiled")
    ref, _ = golden(q, k, v, causal=True)
    assert out.shape == (9, 8)
    assert_close(torch.from_numpy(out), ref[0, 0], budget(torch.float32, 8, 9), "numpy")


def test_dropout_refused():
    q, k, v = rand_qkv(1, 1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="dropout"):
        attnkit.attention(q, k, v, dropout_p=0.1, backend="tiled")


def test_frommod_is_evaluated_every_call_and_builtin_plan_is_closed_form(monkeypatch):
    """The caching contract: an opaque mask_mod is evaluated afresh on each call (its data may
    change); a built-in mask's plan is computed in closed form (its mask_mod is never called)."""
    L, calls = 512, []

    def band(b, h, q, kv):
        calls.append(1)
        return (q - kv).abs() <= 64

    wrapped = M.from_mod(band)
    _blocks.work_list(wrapped, None, 1, 2, L, L, 64, 64, L)
    n1 = len(calls)
    _blocks.work_list(wrapped, None, 1, 2, L, L, 64, 64, L)
    assert n1 > 0 and len(calls) > n1

    def boom(self, L, S):
        raise AssertionError("the built-in plan evaluated the mask pointwise")

    monkeypatch.setattr(M.SlidingWindow, "bind", boom)
    p = _blocks.work_list(M.sliding_window(256), None, 1, 8, 16384, 16384, 64, 64, 16384)
    assert 0 < p.density < 0.05


def test_env_block_sizes(monkeypatch):
    monkeypatch.setenv("ATTNKIT_TILED_BLOCKS", "8,8,16")
    assert tiled._sizes() == (8, 8, 16)
    q, k, v = rand_qkv(1, 2, 1, 30, 30, 8)
    out = attnkit.attention(q, k, v, backend="tiled", mask=M.sliding_window(5))
    ref, _ = golden(q, k, v, mask=M.sliding_window(5))
    assert_close(out, ref, budget(torch.float32, 8, 30), "env blocks")


def test_identical_query_blocks_merge_into_one_group():
    # no mask: one group, one run over all keys (the fused worker then makes one kernel call)
    p = _blocks.work_list(None, None, 1, 2, 300, 200, 64, 64, 200, max_group_elems=1 << 22, count_all=False)
    assert p.groups == ((0, 300, ((0, 200, ()),)),)
    # padding: every query block has the same runs (full tiles, then one partial tile)
    p = _blocks.work_list(M.padding([100]), None, 1, 2, 256, 256, 64, 64, 256, max_group_elems=1 << 22, count_all=False)
    assert p.groups == ((0, 256, ((0, 128, ((64, 128),)),)),)


def test_nan_reaches_exactly_the_rows_that_see_it():
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 8)
    k[0, :, 10, 0] = float("nan")  # key 10: seen by queries 10..13 under a window of 4
    out = attnkit.attention(q, k, v, mask=M.sliding_window(4), backend="tiled")
    rows = torch.isnan(out[0, 0]).any(dim=-1).nonzero().flatten().tolist()
    assert rows == [10, 11, 12, 13]


@pytest.mark.parametrize("L, S, align", [(300, 300, "bottom_right"), (130, 517, "bottom_right"),
                                         (200, 90, "top_left"), (90, 200, "top_left"), (1, 300, "top_left")])
@pytest.mark.parametrize("H, Hkv", [(4, 4), (6, 2)])
def test_causal_alone_uses_the_kernels_causal_skipping_and_is_exact(L, S, align, H, Hkv):
    """tiled's fused worker runs a mask that is exactly causal as whole-sequence kernel calls with
    is_causal (bottom-right L < S: an unmasked key range plus a causal one, merged); outputs, lse
    and gradients against the float64 golden, GQA without copying K/V."""
    from attnkit.backends import _tiled_fused

    g = torch.Generator().manual_seed(L + S)
    q = torch.randn(2, H, L, 32, generator=g).requires_grad_()
    k = torch.randn(2, Hkv, S, 32, generator=g).requires_grad_()
    v = torch.randn(2, Hkv, S, 32, generator=g).requires_grad_()
    mask = M.causal(align)
    with fused(True):
        d = attnkit.dispatch(q, k, v, mask=mask, backend="tiled")
    assert d.worker == "fused" and "causal block skipping" in d.worker_reason, d
    req = attnkit._request.make_request(q, k, v, mask=mask, causal=False, scale=None, score_mod=None,
                                        dropout_p=0.0, return_lse=False, backend="tiled")
    assert _tiled_fused.causal_pieces(req, None) is not None
    out, lse = attnkit.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    ref, ref_lse = golden(q, k, v, mask=mask)
    tol = budget(torch.float32, 32, S)
    assert (out.double() - ref).abs().max().item() <= tol
    assert (lse.double() - ref_lse).abs().max().item() <= tol
    go = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), go)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    refs = torch.autograd.grad(attnkit.attention(qd, kd, vd, mask=mask, backend="eager"), (qd, kd, vd), go.double())
    for a, b in zip(grads, refs, strict=True):
        assert (a.double() - b).abs().max().item() <= 20 * tol * max(1.0, b.abs().max().item())


def test_a_mask_mod_that_differs_per_batch_row_on_a_banded_float64_call():
    """The fused worker's batched band (stacked query blocks of one batch row) takes that row's mask tile
    when the mask_mod's result has a batch dim (it crashed: a (B, ...) tile against one row's call)."""
    q, k, v = (torch.randn(2, 4, 300, 32, dtype=torch.float64) for _ in range(3))
    lim = torch.tensor([48, 20])
    mod = lambda b, h, q_, kv: (q_ >= kv) & (q_ - kv <= lim[b])  # noqa: E731
    out = attnkit.attention(q, k, v, mask=mod, backend="tiled")
    ref = attnkit.attention(q, k, v, mask=mod, backend="reference")
    assert torch.allclose(out, torch.as_tensor(ref), atol=1e-12)
