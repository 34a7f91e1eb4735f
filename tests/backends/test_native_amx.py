"""The compiled kernel's bf16 forward and backward on AMX tiles (csrc/attn_amx.h): on a CPU with AMX a bf16 call
multiplies bf16 itself (forward: S = Q Kᵀ and O += P V on tiles, fp32 accumulation, P rounded to bf16 once per tile;
S's depth D zero-padded to a multiple of 32 where it is not one; backward, where D and Dv are multiples of 16: S,
dP = dO Vᵀ (their depths padded alike), dV += Pᵀ dO, dK += dSᵀ Q
and dQ = dS K on tiles, P and dS rounded to bf16 where they are multiplied); every other step is the fp32
kernel's (scores, softmax statistics, lse, delta, masks, score_mods in fp32).

The error budget, per output element, against the float64 golden on the same bf16 values:
  the fp32 kernel's budget (conftest's, on the exact products: bf16 × bf16 is exact in fp32)
  + 2⁻⁹ · max|v|      P rounded to bf16: at most half an ulp (2⁻⁹ relative) of each weight, Σ p = 1
  + 2⁻⁸ · |ref|       the output rounded once to bf16 (UNIT, as test_native_low_precision)
lse is the fp32 statistics' own (P's rounding never reaches it): the fp32 budget.
Gradients: 4 bf16 units of the largest (each is rounded to bf16 once; P's and dS's roundings add at most half a
unit of each term; measured 2–4e-3 of the largest, the widening path's 1.4–3.8e-3).

Skipped where the kernel does not run on AMX (no AMX, or ATTNKIT_NATIVE_BF16_DOT=0); the widening path those CPUs
run is tests/backends/test_native_low_precision.py's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EPS, budget, golden

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM
from attnkit.backends import _native

pytestmark = [pytest.mark.skipif(not (_native.available() and _native.bf16_dot()),
                                 reason="this CPU has no AMX (or ATTNKIT_NATIVE_BF16_DOT=0): the kernel widens bf16 "
                                        "to fp32 here, tested bit for bit by test_native_low_precision.py"),
              pytest.mark.usefixtures("kernel_takes_bf16")]

UNIT = 2.0 ** -8


def _checkerboard(b, h, q_idx, kv_idx):  # not intervals: the tile map with partial bits
    return ((q_idx // 8 + kv_idx // 8) % 2 == 0) | (q_idx == kv_idx)


def _cases(B, H, L, S):
    yield "causal", dict(mask=M.causal())
    yield "window", dict(mask=M.sliding_window(37))
    yield "padding", dict(mask=M.padding([S, S // 3][:B]))
    yield "document", dict(mask=M.document(torch.arange(S) * 3 // S))
    yield "mask_mod", dict(mask=attnkit.create_block_mask(_checkerboard, None, None, L, S))
    yield "alibi", dict(mask=M.causal(), score_mod=SM.alibi(attnkit.positional.alibi_slopes(H)))
    yield "softcap", dict(mask=M.causal(), score_mod=SM.softcap(5.0))
    yield "none", dict()


def _layout(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "bshd":  # (B, S, H, D) memory viewed as (B, H, S, D)
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "step2":  # every other row of a longer buffer
        return torch.cat([x, x], -2).reshape(x.shape[0], x.shape[1], x.shape[2], 2, x.shape[3])[..., 0, :]
    return x


def _qkv(B, H, Hkv, L, S, D, Dv, layout="contiguous", grad=False):
    g = torch.Generator().manual_seed(L * 1000 + S + D)
    q, k, v = (torch.randn(B, h, n, d, generator=g).bfloat16() for h, n, d in ((H, L, D), (Hkv, S, D), (Hkv, S, Dv)))
    q, k, v = (_layout(t, layout) for t in (q, k, v))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _tol(ref, v, D, S):
    return (4 * budget(torch.float32, D, S) * max(1.0, ref.abs().max().item()) + 2.0 ** -9 * v.double().abs().max()
            + UNIT * ref.abs())


# D not a multiple of 32 (16, 80, odd 17 and 1): the scores' depth zero-padded to one on the tiles
@pytest.mark.parametrize("shape", [(2, 4, 2, 130, 130, 64, 64), (2, 4, 4, 70, 100, 32, 40), (1, 2, 1, 77, 200, 128, 16),
                                   (1, 2, 2, 64, 64, 64, 130), (2, 4, 4, 64, 64, 16, 16), (1, 3, 1, 90, 150, 80, 48),
                                   (1, 2, 2, 40, 70, 17, 20), (1, 2, 1, 33, 65, 1, 16)],
                         ids=lambda s: "B{}H{}/{}L{}S{}D{}Dv{}".format(*s))
@pytest.mark.parametrize("layout", ["contiguous", "bshd", "step2"])
def test_forward_within_the_bf16_budget_of_float64_for_every_mask(shape, layout):
    B, H, Hkv, L, S, D, Dv = shape
    q, k, v = _qkv(B, H, Hkv, L, S, D, Dv, layout)
    for name, kw in _cases(B, H, L, S):
        if name in ("causal", "alibi", "softcap") and L != S:
            kw["mask"] = M.causal("top_left")
        d = attnkit.dispatch(q, k, v, backend="tiled", **kw)
        assert d.worker == "native", (name, d)
        with torch.no_grad():
            out, lse = attnkit.attention(q, k, v, backend="tiled", return_lse=True, **kw)
        ref, ref_lse = golden(q, k, v, **kw)
        ref, ref_lse = torch.as_tensor(ref), torch.as_tensor(ref_lse)
        err = (out.double() - ref).abs()
        assert out.dtype is torch.bfloat16 and bool((err <= _tol(ref, v, D, S)).all()), (name, err.max().item())
        live = torch.isfinite(ref_lse)
        assert bool((lse[~live] == float("-inf")).all()), name  # dead rows: lse -inf (and out 0, checked above)
        assert (lse.double() - ref_lse)[live].abs().max().item() <= 4 * budget(torch.float32, D, S) * 10, name


@pytest.mark.parametrize("D", [64, 16, 80])
def test_the_tiles_ran_and_differ_from_the_widening_path_only_by_ps_rounding(widened_bf16, D):
    """With AMX switched off the same call widens (bit for bit the fp32 kernel's); on, P's rounding shows, within
    2⁻⁹ · max|v| + the output's rounding of the widened answer (the tiles did run: the bits differ) — at D = 16
    and 80 too (the scores' depth zero-padded to 32 and 96)."""
    q, k, v = _qkv(1, 4, 2, 200, 200, D, 64)
    with torch.no_grad():
        widened = attnkit.attention(q, k, v, backend="tiled", causal=True)
        _native.set_bf16_dot(True)
        assert _native.bf16_dot()
        tiles = attnkit.attention(q, k, v, backend="tiled", causal=True)
    diff = (tiles.double() - widened.double()).abs()
    assert diff.max().item() > 0
    assert bool((diff <= 2.0 ** -9 * v.double().abs().max() + 2 * UNIT * widened.double().abs() + 1e-6).all())


@pytest.mark.parametrize("D", [64, 16])
def test_dead_rows_finfo_min_rows_and_a_nan_query_row(D):
    """A batch row of zero length (every query row dead: out 0, lse -inf), rows whose every score is fp32's finfo.min
    (a score_mod: all equal, so the visible values' mean, not a dead row), and a NaN in one query row (that row
    NaN, the others within budget)."""
    B, H, L, S = 2, 2, 96, 96
    q, k, v = _qkv(B, H, H, L, S, D, D)
    lo = torch.finfo(torch.float32).min
    mods = {"padding 0": (dict(mask=M.padding([S, 0])), None),
            "finfo.min rows": (dict(mask=M.causal(), score_mod=lambda s, b, h, i, j: torch.where(i < 40, lo, s)), None),
            "nan q row": (dict(mask=M.causal()), (0, 1, 70))}
    for name, (kw, nan_at) in mods.items():
        qq = q.clone()
        if nan_at:
            qq[nan_at[0], nan_at[1], nan_at[2], 3] = float("nan")
        with torch.no_grad():
            out, lse = attnkit.attention(qq, k, v, backend="tiled", return_lse=True, **kw)
        ref, ref_lse = (torch.as_tensor(x) for x in golden(qq, k, v, **kw))
        nan_ref = ref.isnan()
        assert bool((out.isnan() == nan_ref).all()), name
        assert bool((lse.isnan() == ref_lse.isnan()).all()) and bool(((lse == float("-inf")) == (ref_lse == float(
            "-inf"))).all()), name
        ok = ~nan_ref
        assert bool(((out.double() - ref).abs()[ok] <= _tol(ref.nan_to_num(), v, D, S)[ok]).all()), name
        if name == "padding 0":
            assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all())
        if name == "finfo.min rows":
            j = torch.arange(S)
            mean = v.double()[0, 0][None, :, :].expand(40, S, D)
            want = torch.stack([mean[i][j <= i].mean(0) for i in range(40)])
            assert (out[0, 0, :40].double() - want).abs().max().item() <= 2.0 ** -9 * 4 + UNIT * 4


@pytest.mark.parametrize("shape", [(1, 4, 2, 150, 150, 64, 64), (2, 2, 2, 70, 130, 128, 32),
                                   (1, 2, 1, 100, 100, 32, 48), (2, 2, 2, 64, 64, 16, 16), (1, 2, 1, 70, 90, 80, 48),
                                   (1, 2, 1, 40, 70, 17, 20)],
                         ids=lambda s: "B{}H{}/{}L{}S{}D{}Dv{}".format(*s))
def test_gradients_on_tiles_within_the_bf16_budget(shape, widened_bf16):
    """Every mask kind, an expanded gradient (stride 0) and bshd inputs; D or Dv not a multiple of 32 (S's and dP's
    depths zero-padded on the tiles), and D = 17, Dv = 20: the forward on tiles, the backward widened (dK's, dQ's and
    dV's columns on tiles must be multiples of 16). Against the widening path: the tiles ran (other bits)."""
    B, H, Hkv, L, S, D, Dv = shape
    _native.set_bf16_dot(True)
    for layout in ("contiguous", "bshd"):
        q, k, v = _qkv(B, H, Hkv, L, S, D, Dv, layout, grad=True)
        for name, kw in _cases(B, H, L, S):
            if name in ("causal", "alibi", "softcap") and L != S:
                kw["mask"] = M.causal("top_left")
            assert attnkit.dispatch(q, k, v, backend="tiled", **kw).worker == "native"
            go = torch.randn(B, H, L, Dv, generator=torch.Generator().manual_seed(3)).bfloat16()
            if name == "none":
                go = torch.ones((), dtype=torch.bfloat16).expand(B, H, L, Dv)  # the gradient of out.sum()
            got = torch.autograd.grad(attnkit.attention(q, k, v, backend="tiled", **kw), (q, k, v), go)
            q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
            want = torch.autograd.grad(attnkit.attention(q2, k2, v2, backend="eager", **kw), (q2, k2, v2),
                                       go.double())
            for n, a, b in zip("qkv", got, want, strict=True):
                tol = 4 * EPS[torch.bfloat16] * max(1.0, b.abs().max().item())
                assert a.dtype is torch.bfloat16 and (a.double() - b).abs().max().item() <= tol, (layout, name, n)
    if D % 16 == 0 and Dv % 16 == 0:  # the backward's own products ran on tiles: the forward's output fixed, other bits
        q, k, v = _qkv(B, H, Hkv, L, S, D, Dv, grad=True)
        out, lse = attnkit.attention(q, k, v, backend="tiled", causal=True, return_lse=True)
        lo, hi = M.causal().row_intervals(1, L, S)
        go = torch.randn(B, H, L, Dv).bfloat16()
        args = (q.detach(), k.detach(), v.detach(), lo, hi, D ** -0.5, out.detach().float(), lse.detach(), go)
        tiles = _native.backward(*args)
        _native.set_bf16_dot(False)
        widened = _native.backward(*args)
        assert any(not torch.equal(a, b) for a, b in zip(tiles, widened, strict=True))


def test_same_bits_on_one_and_two_threads():
    q, k, v = _qkv(1, 8, 2, 300, 300, 64, 64)
    before = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            with torch.no_grad():
                outs.append(attnkit.attention(q, k, v, backend="tiled", mask=M.sliding_window(100)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_torchs_own_bf16_kernels_answer_the_same_around_a_tile_call():
    """torch's bf16 kernels use AMX too (oneDNN): the kernel saves the tile configuration it finds and restores it
    (or releases the tiles) when its forward ends, so torch's answers before and after one of its calls agree."""
    g = torch.Generator().manual_seed(9)
    a, b = (torch.randn(256, 256, generator=g).bfloat16() for _ in range(2))
    q, k, v = _qkv(1, 4, 4, 256, 256, 64, 64)
    mm0 = a @ b
    sd0 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for _ in range(3):
        with torch.no_grad():
            attnkit.attention(q, k, v, backend="tiled", mask=M.sliding_window(50))
        assert torch.equal(a @ b, mm0)
        assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), sd0)

