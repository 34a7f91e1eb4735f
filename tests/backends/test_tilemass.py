"""Attention mass per tile (attnkit.tile_mass): checked against a dense float64 softmax.

Error budget (fp32 inputs, compared with the float64 softmax of the same fp32 numbers): a
score q·k·scale is within D·eps32·|q||k|·scale of exact; a weight's relative error is at
most that plus a few eps32 from exp and the division; a tile mass is a sum of ≤ bm·bn
weights whose row totals are ≤ 1, so |Δmass| ≤ bm · (err_score + 8·eps32). fp64 inputs: 1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.backends._tilemass import _runs_of
from attnkit.tilemass import tile_mass

EPS32 = float(np.finfo(np.float32).eps)


def _dense_weights(q, k, allowed=None, bias=None, scale=None, softcap=None):
    """float64 softmax weights (B, H, L, S) of the given numbers; dead rows 0."""
    q, k = q.double(), k.double()
    H, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // Hkv, dim=1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double()
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).min)
    p = torch.exp(s - m)
    l_i = p.sum(-1, keepdim=True)
    return torch.where(l_i > 0, p / torch.where(l_i > 0, l_i, torch.ones_like(l_i)), torch.zeros_like(p))


def _dense_mass(w, bm, bn):
    B, H, L, S = w.shape
    nq, nk = -(-L // bm), -(-S // bn)
    w = torch.nn.functional.pad(w, (0, nk * bn - S, 0, nq * bm - L))
    return w.view(B, H, nq, bm, nk, bn).sum((3, 5))  # (B, H, nq, nk)


def _budget(q, k, bm):
    D = q.shape[-1]
    qk = float(q.double().norm(dim=-1).max() * k.double().norm(dim=-1).max()) * D ** -0.5
    return bm * (D * EPS32 * qk + 8 * EPS32)


def _dead_row_mask(L, S, ids):
    """packed documents, causal inside, and query rows 100..109 seeing nothing (dead rows)."""
    alive = masks.from_mod(lambda b, h, q, kv: (q < 100) | (q >= 110))
    return masks.document(ids) & masks.causal() & alive


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masses_match_dense_float64_gqa_odd_blocks_dead_rows(dtype):
    torch.manual_seed(0)
    B, H, Hkv, L, D = 2, 6, 2, 300, 24
    bm, bn = 37, 29
    q = torch.randn(B, H, L, D, dtype=dtype) * 1.5
    k = torch.randn(B, Hkv, L, D, dtype=dtype) * 1.5
    ids = torch.tensor([0] * 50 + [1] * 97 + [2] * 153)
    m = _dead_row_mask(L, L, ids)
    tm = tile_mass(q, k, mask=m, block=(bm, bn))
    allowed = m.materialize(B, H, L, L)
    w = _dense_weights(q, k, allowed)
    ref = _dense_mass(w, bm, bn)
    t = tm.tiles
    tol = _budget(q, k, bm) if dtype == torch.float32 else 1e-12
    err = (ref[:, :, t[:, 0], t[:, 1]] - tm.mass.double()).abs().max().item()
    assert err <= tol, (err, tol)
    # every tile the plan leaves empty carries no weight, and no computed tile is missing
    plan = attnkit.plan(m, L, B=B, H=H, block=(bm, bn))
    assert torch.equal(tm.kinds, plan.collapsed())
    assert torch.equal(t, torch.nonzero(plan.collapsed() != 0))
    outside = ref.clone()
    outside[:, :, t[:, 0], t[:, 1]] = 0
    assert outside.abs().max().item() == 0.0
    # dead rows: weight 0, lse -inf, never NaN; each block's masses add up to its live rows
    assert not torch.isnan(tm.mass).any()
    assert torch.isneginf(tm.lse[:, :, 100:110]).all() and torch.isfinite(tm.lse[:, :, :100]).all()
    nq = tm.shape[0]
    per_block = torch.zeros(B, H, nq, dtype=torch.float64).index_add_(2, t[:, 0], tm.mass.double())
    live = allowed.any(-1).view(B, H, L)
    expect = torch.nn.functional.pad(live.double(), (0, nq * bm - L)).view(B, H, nq, bm).sum(-1)
    assert torch.equal(tm.live_rows.double(), expect)
    assert (per_block - expect).abs().max().item() <= (1e-4 if dtype == torch.float32 else 1e-10)
    # the row lse is attnkit.attention's
    v = torch.randn(B, Hkv, L, 8, dtype=dtype)
    _, lse = attnkit.attention(q, k, v, mask=m, return_lse=True)
    fin = torch.isfinite(lse)
    assert torch.equal(fin, torch.isfinite(tm.lse))
    assert (lse[fin].double() - tm.lse[fin].double()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-12)


def test_rows_of_huge_finite_negatives_still_sum_to_one():
    """A float bias of finfo.min (padding as some models write it): rows whose every score is a
    huge finite negative still have weights summing to 1 (rebuilding exp(s - lse) from an fp32
    lse would give each weight exp(0) = 1 there), and they match the float64 softmax."""
    torch.manual_seed(1)
    L, S, D = 70, 90, 16
    q, k = torch.randn(1, 2, L, D), torch.randn(1, 2, S, D)
    lo = torch.finfo(torch.float32).min
    bias = torch.zeros(1, 1, L, S)
    bias[..., 10:20, :] = lo  # whole rows at finfo.min
    bias[..., 30:40, 45:] = lo  # half rows
    bias[..., 50:55, :] = -1e30
    tm = tile_mass(q, k, mask=bias, block=(16, 32))
    w = _dense_weights(q, k, bias=bias)
    ref = _dense_mass(w, 16, 32)
    t = tm.tiles
    assert (ref[:, :, t[:, 0], t[:, 1]] - tm.mass.double()).abs().max().item() <= _budget(q, k, 16)
    rows = torch.zeros(1, 2, tm.shape[0], dtype=torch.float64).index_add_(2, t[:, 0], tm.mass.double())
    expect = torch.tensor([16.0, 16, 16, 16, 6])  # every row is live: it sums to 1
    assert (rows - expect).abs().max().item() < 1e-4
    wr = tm.row_weights(12)
    assert torch.allclose(wr.double(), w[0, :, 12], atol=1e-6) and abs(float(wr.sum(-1).mean()) - 1) < 1e-5


def test_row_and_tile_weights_on_demand_are_exact():
    torch.manual_seed(2)
    B, H, Hkv, L, S, D = 1, 4, 1, 97, 129, 59
    q, k = torch.randn(B, H, L, D, dtype=torch.float64), torch.randn(B, Hkv, S, D, dtype=torch.float64)
    m = masks.sliding_window(40)  # bottom-right aligned: L != S
    tm = tile_mass(q, k, mask=m, block=(17, 13), max_run=26)  # runs capped at 2 key blocks
    w = _dense_weights(q, k, m.materialize(B, H, L, S))
    for i in (0, 50, 96):
        assert (tm.row_weights(i) - w[0, :, i]).abs().max().item() < 1e-13
    assert (tm.row_weights(7, heads=[2]) - w[0, 2:3, 7]).abs().max().item() < 1e-13
    for a, c in tm.tiles.tolist()[::5]:
        tw = tm.tile_weights(a, c)
        ref = w[0, :, a * 17:(a + 1) * 17, c * 13:(c + 1) * 13]
        assert tw.shape == ref.shape and (tw - ref).abs().max().item() < 1e-13
        idx = int(((tm.tiles[:, 0] == a) & (tm.tiles[:, 1] == c)).nonzero())
        assert abs(float(tw.sum((1, 2))[1]) - float(tm.mass[0, 1, idx])) < 1e-12
    # an empty tile: zeros, no work
    a, c = next((a, c) for a in range(tm.shape[0]) for c in range(tm.shape[1]) if tm.kinds[a, c] == 0)
    assert tm.tile_weights(a, c).abs().max().item() == 0.0


def test_score_mod_and_bool_tensor_mask():
    torch.manual_seed(3)
    L, D = 45, 16
    q, k = torch.randn(1, 2, L, D) * 3, torch.randn(1, 2, L, D) * 3
    allowed = torch.rand(1, 1, L, L) > 0.3
    allowed[..., 5, :] = False  # a dead row
    tm = tile_mass(q, k, mask=allowed, score_mod=attnkit.score_mods.softcap(5.0), block=(8, 8))
    w = _dense_weights(q, k, allowed=allowed, softcap=5.0)
    t = tm.tiles
    assert (_dense_mass(w, 8, 8)[:, :, t[:, 0], t[:, 1]] - tm.mass.double()).abs().max().item() <= _budget(q, k, 8)
    assert tm.live_rows[0, 0, 0].item() == 7


def test_work_list_covers_exactly_the_plans_tiles():
    """The GEMM runs visit every non-empty tile once and no empty tile (the plan decides)."""
    ids = torch.repeat_interleave(torch.arange(7), torch.tensor([100, 3, 250, 64, 1, 500, 82]))
    m = masks.document(ids) & masks.causal()
    p = attnkit.plan(m, 1000, block=(32, 48))
    kinds = p.collapsed()
    runs = _runs_of(kinds, (32, 48), 1000, max_run=96)
    for qi, rr in enumerate(runs):
        seen = [c for a, b, _ in rr for c in range(a, b)]
        assert seen == sorted(set(seen)) == torch.nonzero(kinds[qi]).flatten().tolist()
        assert all(b - a <= 2 for a, b, _ in rr)  # max_run 96 keys = 2 blocks of 48
        assert all(part == bool((kinds[qi, a:b] == 1).any()) for a, b, part in rr)


def test_inputs_numpy_unbatched_and_plans():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((50, 8)), rng.standard_normal((50, 8))
    tm = tile_mass(q, k, causal=True, block=16)
    assert (tm.B, tm.H, tm.L, tm.S) == (1, 1, 50, 50)
    assert abs(float(tm.mass.sum()) - 50) < 1e-9
    d = tm.dense(share=True)
    assert d.shape == (4, 4) and np.allclose(d.sum(1), 1) and d[0, 1] == 0
    p = attnkit.plan(masks.causal(), 50, block=(10, 25))
    tp = tile_mass(torch.from_numpy(q), torch.from_numpy(k), mask=p)
    assert tp.block == (10, 25) and tp.shape == (5, 2)
    assert "tile mass" in tp.summary() and repr(tp).startswith("TileMass(")


@pytest.mark.parametrize("call, needle", [
    (lambda q, k: tile_mass(q, k, block=(0, 4)), "block: expected (bm, bn)"),
    (lambda q, k: tile_mass(q, k[..., :3]), "k: expected head dim D=8"),
    (lambda q, k: tile_mass(q, k, max_run=0), "max_run: expected an int >= 1"),
    (lambda q, k: tile_mass(q, k, workers=0), "workers: expected an int >= 1"),
    (lambda q, k: tile_mass(q, k, mask=attnkit.plan(masks.causal(), 20, block=8), block=(4, 4)), "block: the plan"),
    # an explicit (64, 64), the old default, was taken for "not given" and the plan's 8 × 8 tiles used silently
    (lambda q, k: tile_mass(q, k, mask=attnkit.plan(masks.causal(), 20, block=8), block=(64, 64)), "block: the plan"),
    (lambda q, k: tile_mass(q, k).row_weights(20), "i: expected a query row in 0..19"),
    (lambda q, k: tile_mass(q, k).tile_weights(0, 9), "kb: expected a block index"),
    (lambda q, k: tile_mass(q, k).dense(head=3), "head: expected None (mean of heads) or an int in 0..1"),
    (lambda q, k: tile_mass(q, k).row_weights(0, heads=[5]), "heads: expected None"),
    (lambda q, k: tile_mass(q.tolist(), k), "q: expected a torch.Tensor or numpy.ndarray"),
])
def test_bad_inputs_name_the_argument(call, needle):
    q, k = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    with pytest.raises((ValueError, TypeError), match=None) as e:
        call(q, k)
    assert needle in str(e.value), str(e.value)


def test_threads_give_the_same_masses():
    torch.manual_seed(4)
    q, k = torch.randn(1, 4, 1000, 32), torch.randn(1, 2, 1000, 32)
    m = masks.sliding_window(100)
    a, b = tile_mass(q, k, mask=m, workers=1), tile_mass(q, k, mask=m, workers=3)
    assert torch.equal(a.mass, b.mass) and torch.equal(a.lse, b.lse)


def test_top_off_the_diagonal_never_lists_a_tile_near_it():
    """With fewer tiles away from the diagonal than asked for, top(off_diagonal=True) filled its list with near
    tiles reported as mass 0, share 0 (tile (0, 0) really holds mass 64): in summary(), `attnkit long` and the page."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1024, 16, generator=g)
    tm = attnkit.tile_mass(q, q, mask=attnkit.masks.sliding_window(16), block=64)
    assert tm.top(3, off_diagonal=True) == []
    assert "none, every tile is within two blocks of it" in tm.summary()
    causal = attnkit.tile_mass(q, q, causal=True, block=64)
    far = causal.top(50, off_diagonal=True)
    assert far and all(m > 0 and abs(q0 - k0) >= 128 for m, _, (q0, _q1), (k0, _k1) in far)
