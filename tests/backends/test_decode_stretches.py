"""A decode step whose rows are a few stretches of keys (attention sinks and a window): one decode call, each row
seeing the union of its stretches (``NativeDecode._run_stretches``: lo / hi planes), on the full path and on every
replay (the exact signature, a decode loop's family of a mod, a bool tensor each call), at every cache length.

Error budget: the decode entry's (fp32 arithmetic, bf16 / fp16 widened exactly; its split-K merge a few fp32
roundings per row): conftest's fp32 budget against float64 on the same values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import budget, full_path, golden, require_kernel

import attnkit
from attnkit import _fast, score_mods
from attnkit.backends import native

S_LONG = 4396  # a long cache: split over the threads (split-K), the stretches in different chunks


def _inputs(B, H, Hkv, L, S, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, 16, generator=g).to(dtype), torch.randn(B, Hkv, S, 16, generator=g).to(dtype),
            torch.randn(B, Hkv, S, 16, generator=g).to(dtype))


def _golden(q, k, v, mask, **kw):
    g = q.shape[1] // k.shape[1]
    return golden(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), mask=mask, **kw)


def _sinks(S, sinks=4, window=700):
    return lambda b, h, qi, kv: (kv < sinks) | (kv > qi + S - 1 - window)


def _dense(mod, B, H, L, S):
    idx = [torch.arange(n).view(*(n if d == i else 1 for d in range(4))) for i, n in enumerate((B, H, L, S))]
    return mod(*idx).expand(B, H, L, S)


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_and_a_window_run_on_the_decode_entry_exactly(L, dtype):
    require_kernel()
    S = S_LONG
    q, k, v = _inputs(2, 8, 2, L, S, dtype)
    mod = _sinks(S)
    assert attnkit.dispatch(q, k, v, mask=mod).kernel.name == "native-decode"
    with torch.no_grad():
        out, lse = attnkit.attention(q, k, v, mask=mod, return_lse=True)
        ref, ref_lse = _golden(q, k, v, _dense(mod, 2, 8, L, S))
    assert out.dtype == dtype
    tol = budget(torch.float32, 16, S) if dtype == torch.float32 else budget(dtype, 16, S)
    assert (out.double() - ref).abs().max().item() <= tol
    assert (lse.double() - ref_lse).abs().max().item() <= budget(torch.float32, 16, S)


def test_rows_with_different_stretches_a_dead_row_and_a_score_mod():
    """Query rows with 1, 2, 3 and 0 stretches (the last sees no key: out 0, lse -inf), a soft cap on the scores."""
    require_kernel()
    S = S_LONG

    def mod(b, h, qi, kv):
        return (((qi == 0) & (kv < 300)) | ((qi == 1) & ((kv < 10) | (kv > S - 50)))
                | ((qi == 2) & ((kv % 1500) < 3)))

    q, k, v = _inputs(1, 4, 4, 4, S, seed=1)
    cap = score_mods.softcap(5.0)
    with torch.no_grad():
        assert attnkit.dispatch(q, k, v, mask=mod, score_mod=cap).kernel.name == "native-decode"
        out, lse = attnkit.attention(q, k, v, mask=mod, score_mod=cap, return_lse=True)
        ref, ref_lse = _golden(q, k, v, _dense(mod, 1, 4, 4, S), score_mod=cap)
    live = slice(0, 3)
    assert (out[:, :, live].double() - ref[:, :, live]).abs().max().item() <= budget(torch.float32, 16, S)
    assert (lse[:, :, live].double() - ref_lse[:, :, live]).abs().max().item() <= budget(torch.float32, 16, S)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3])) and torch.isneginf(lse[:, :, 3]).all()


def test_more_stretches_than_the_decode_entry_takes_run_elsewhere_exactly():
    require_kernel()
    S = S_LONG
    mod = lambda b, h, qi, kv: (kv % 800) < 5  # noqa: E731  (six stretches)
    q, k, v = _inputs(1, 4, 2, 1, S, seed=2)
    assert attnkit.dispatch(q, k, v, mask=mod).kernel.name != "native-decode"
    with torch.no_grad():
        out = attnkit.attention(q, k, v, mask=mod)
    ref = _golden(q, k, v, _dense(mod, 1, 4, 1, S))[0]
    assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S)


@pytest.mark.parametrize("cap", [None, lambda s, b, h, qi, kv: 20.0 * torch.tanh(s / 20.0)])
def test_short_caches_run_on_the_decode_entry_too(cap):
    """One call whatever the stretch count: a short cache's step costs what a window alone costs there, below
    SDPA's kernel with the whole mask (benchmarks/decode_sinks.py) — exact, its replays too."""
    require_kernel()
    _fast.clear()
    q, k, v = _inputs(1, 8, 2, 1, 2000, seed=3)
    with torch.no_grad():
        for S in (70, 300, 301, 2000):
            kk, vv = k[:, :, :S], v[:, :, :S]
            mod = _sinks(S, window=min(120, S - 10))
            assert attnkit.dispatch(q, kk, vv, mask=mod, score_mod=cap).kernel.name == "native-decode"
            ref = _golden(q, kk, vv, _dense(mod, 1, 1, 1, S), score_mod=cap)[0]
            for _ in range(2):
                out = attnkit.attention(q, kk, vv, mask=mod, score_mod=cap)
                assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S)
                assert torch.equal(out, full_path(q, kk, vv, mask=mod, score_mod=cap))


def test_repeated_calls_and_a_decode_loop_replay_exactly():
    """The same call again (the exact signature's replay), then a loop one key longer each step with a new mod and a
    new bool tensor each step (the families' replays): every step against the float64 golden."""
    require_kernel()
    _fast.clear()
    S0, steps = S_LONG, 6
    q, cache_k, cache_v = _inputs(1, 8, 2, 1, S0 + steps, seed=4)
    with torch.no_grad():
        for t in range(steps):
            S = S0 + t
            k, v = cache_k[:, :, :S], cache_v[:, :, :S]
            mod = _sinks(S, sinks=3 + t % 2)
            kept = _dense(mod, 1, 1, 1, S)
            ref = _golden(q, k, v, kept)[0]
            for _ in range(2):
                for mask in (mod, kept.clone()):
                    out = attnkit.attention(q, k, v, mask=mask)
                    assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S)
                    assert torch.equal(out, full_path(q, k, v, mask=mask))  # a replay: the full path's bits


def test_a_family_first_seen_with_one_stretch_takes_two_as_the_full_path_does():
    """A decode loop's family learned on a one-stretch mask, then given two stretches (a long cache and a short
    one): the full path's answer, bit for bit."""
    require_kernel()
    q, k, v = _inputs(1, 4, 2, 1, S_LONG, seed=7)
    for S in (S_LONG, 1000):
        _fast.clear()
        kk, vv = k[:, :, :S], v[:, :, :S]
        one = torch.zeros(1, 1, 1, S, dtype=torch.bool)
        one[..., 100:900] = True
        two = one.clone()
        two[..., :4] = True
        with torch.no_grad():
            for m in (one, two, one, two):
                assert torch.equal(attnkit.attention(q, kk, vv, mask=m), full_path(q, kk, vv, mask=m))


def test_a_bool_mask_of_bytes_other_than_0_and_1():
    """A uint8 buffer viewed as bool (bytes of 2: True to torch) gives the stretches torch reads."""
    require_kernel()
    S = S_LONG
    raw = torch.zeros(S, dtype=torch.uint8)
    raw[:4] = 2
    raw[S - 500:] = 1
    mask = raw.view(torch.bool).view(1, 1, 1, S)
    q, k, v = _inputs(1, 4, 2, 1, S, seed=5)
    with torch.no_grad():
        out = attnkit.attention(q, k, v, mask=mask)
    ref = _golden(q, k, v, raw.bool().view(1, 1, 1, S))[0]
    assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S)


def test_nan_in_a_stretch_reaches_the_row():
    require_kernel()
    S = S_LONG
    q, k, v = _inputs(1, 4, 2, 1, S, seed=6)
    v[0, 0, 1, 3] = float("nan")  # inside the sinks
    with torch.no_grad():
        out = attnkit.attention(q, k, v, mask=_sinks(S))
    assert torch.isnan(out[0, :2, 0, 3]).all() and not torch.isnan(out[0, 2:]).any()


@pytest.mark.parametrize("seed", range(6))
def test_the_stretches_of_a_row_equal_a_plain_scan(seed):
    g = np.random.default_rng(seed)
    S = 97
    x = torch.from_numpy(g.random((2, 1, 3, S)) < (0.03 if seed % 2 else 0.5))
    x[0, 0, 0] = False  # a row with no key
    got = native._bool_row_stretches(x, 3, S, most=1000)
    for b in range(2):
        for i in range(3):
            row = x[b, 0, i].tolist()
            want = [(j, j + 1) for j in range(S) if row[j]]
            merged: list = []
            for lo, hi in want:
                if merged and merged[-1][1] == lo:
                    merged[-1] = (merged[-1][0], hi)
                else:
                    merged.append((lo, hi))
            spans = [(int(lo[b, i]), int(hi[b, i])) for lo, hi in zip(*got, strict=True) if hi[b, i] > lo[b, i]]
            assert spans == merged
    one = x[1, 0, 1].view(1, 1, 1, S)  # one shared row: read off its bytes
    got_one = native._bool_row_stretches(one, 4, S, most=1000)
    assert [(int(lo[0, 0]), int(hi[0, 0])) for lo, hi in zip(*got_one, strict=True) if hi[0, 0] > lo[0, 0]] == \
        [(int(lo[1, 1]), int(hi[1, 1])) for lo, hi in zip(*got, strict=True) if hi[1, 1] > lo[1, 1]]
    assert native._bool_row_stretches(one, 1, S, most=0) is None or not one.any()


def test_the_output_is_an_ordinary_tensor():
    """Its own resizable memory, as every other path's output (review finding: a NumPy-backed tensor)."""
    require_kernel()
    q, k, v = _inputs(1, 4, 2, 1, S_LONG, seed=8)
    with torch.no_grad():
        out = attnkit.attention(q, k, v, mask=_sinks(S_LONG))
    out.resize_(2, 4, 1, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, TB, L, S, chunk", [(1, 1, 1, 5000, 0), (2, 2, 3, 700, 64), (2, 1, 2, 130, 0)])
def test_the_decode_entry_reads_stretch_planes(dtype, B, TB, L, S, chunk):
    """``_native.decode`` with lo / hi planes (n, TB, L): each row the union of its stretches — disjoint, touching,
    overlapping, empty (lo >= hi) or past S — against float64; the same bits at 1 and 2 threads."""
    require_kernel()
    from attnkit.backends import _native

    H, Hkv, D = 6, 2, 24
    g = torch.Generator().manual_seed(S + L)
    q, k, v = (torch.randn(B, n, r, D, generator=g).to(dtype) for n, r in ((H, L), (Hkv, S), (Hkv, S)))
    rng = np.random.default_rng(S)
    lo = torch.zeros(4, TB, L, dtype=torch.int32)
    hi = torch.zeros(4, TB, L, dtype=torch.int32)
    allowed = torch.zeros(TB, L, S, dtype=torch.bool)
    for b in range(TB):
        for i in range(L):
            cuts = sorted(int(c) for c in rng.choice(S, 6, replace=False))
            spans = [(cuts[0], cuts[1]), (cuts[1], cuts[2] + 1), (cuts[2] - 3, cuts[3]), (cuts[5], cuts[4])]
            if b == 0 and i == 0:
                spans = [(0, 0), (S - 5, S + 40), (7, 3), (1, 2)]  # empty, past S, reversed (empty), one key
            for t, (a, e) in enumerate(spans):
                lo[t, b, i], hi[t, b, i] = a, e
                allowed[b, i, max(a, 0):min(e, S)] = True
    dead = lo.clone(), lo.clone()  # a row in no stretch
    scale = D ** -0.5
    qq = q.double()
    kk, vv = (x.double().repeat_interleave(H // Hkv, 1) for x in (k, v))
    s = (qq @ kk.transpose(-1, -2) * scale).masked_fill(~allowed[:, None].expand(B, H, L, S), -torch.inf)
    ref = torch.softmax(s, -1) @ vv
    outs = []
    for threads in (1, 2):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out, lse = _native.decode(q, k, v, lo, hi, scale, chunk=chunk)
        finally:
            torch.set_num_threads(prev)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert (outs[0].double() - ref).abs().max().item() <= budget(torch.float32, D, S)
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max().item() <= budget(torch.float32, D, S) * 10
    out, lse = _native.decode(q, k, v, *dead, scale)
    assert not out.any() and torch.isneginf(lse).all()


def test_too_many_stretch_planes_are_refused_by_name():
    require_kernel()
    from attnkit.backends import _native

    q, k, v = _inputs(1, 4, 2, 1, 50)
    lo = torch.zeros(_native.MAX_PLANES + 1, 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"lo, hi must be int32 .* stretches"):
        _native.decode(q, k, v, lo, lo.clone(), 0.25)


@pytest.mark.parametrize("H, Hkv, L, S", [(80, 1, 1, 1000), (64, 8, 10, 700), (40, 8, 16, 300), (71, 1, 1, 5000)])
def test_more_than_64_rows_per_kv_head_see_every_stretch(H, Hkv, L, S):
    """g·L > 64 rows per kv head make several units, the last one short (review finding: its tile check read the
    wrong stretch entries there, so the window's tiles were skipped for those rows): sinks + a window through
    ``attention`` against float64, at 1 and 2 threads."""
    require_kernel()
    _fast.clear()
    q, k, v = _inputs(1, H, Hkv, L, S, seed=H + L)
    mod = _sinks(S, window=min(200, S // 2))
    assert attnkit.dispatch(q, k, v, mask=mod).kernel.name == "native-decode"
    ref = _golden(q, k, v, _dense(mod, 1, 1, L, S))[0]
    prev = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad():
                out = attnkit.attention(q, k, v, mask=mod)
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S), threads
    finally:
        torch.set_num_threads(prev)


def test_a_prepared_record_refuses_rows_of_another_shape():
    """A prepared decode call reads as many rows as it was prepared for: rows of another shape are refused, never
    read past."""
    require_kernel()
    from attnkit.backends import _native

    q, k, v = _inputs(1, 4, 2, 1, 50)
    lo = torch.zeros(4, 1, 1, dtype=torch.int32)
    run = _native.decode_step(q, k, v, lo, lo + 50)
    assert run(q, k, v, 0.25, lo, lo + 50).shape == (1, 4, 1, 16)
    with pytest.raises(ValueError, match="prepared shape"):
        run(q, k, v, 0.25, lo[0], lo[0] + 50)


@pytest.mark.parametrize("seed", range(12))
def test_random_stretch_planes_against_float64(seed):
    """Random calls of the planes entry: 1-8 planes of random stretches (overlapping, touching, empty, reversed,
    before 0 or past S), TB = 1 or B, L up to 16, g·L up to 96 rows per kv head (units of 64 and a short one),
    fp32 / bf16 / fp16, split-K chunks of 64 or chosen; rows in no stretch give 0 and lse -inf."""
    require_kernel()
    from attnkit.backends import _native

    rng = np.random.default_rng(100 + seed)
    B = int(rng.integers(1, 3))
    TB = int(rng.choice([1, B]))
    Hkv = int(rng.integers(1, 3))
    g = int(rng.choice([1, 3, 8, 12]))
    L = int(rng.integers(1, 17)) if g < 8 else int(rng.integers(1, 9))
    H, S, D = Hkv * g, int(rng.integers(1, 900)), int(rng.choice([8, 24, 40]))
    n = int(rng.integers(1, _native.MAX_PLANES + 1))
    dtype = (torch.float32, torch.bfloat16, torch.float16)[seed % 3]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, r, D, generator=gen).to(dtype) for h, r in ((H, L), (Hkv, S), (Hkv, S)))
    lo = torch.from_numpy(rng.integers(-20, S + 20, (n, TB, L)).astype(np.int32))
    hi = (lo + torch.from_numpy(rng.integers(-5, S // 2 + 2, (n, TB, L)).astype(np.int32))).contiguous()
    j = torch.arange(S)
    allowed = ((j >= lo[..., None]) & (j < hi[..., None])).any(0)  # (TB, L, S): the union of the stretches
    s = (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(~allowed[:, None].expand(B, H, L, S), -torch.inf)
    dead = ~allowed.any(-1)[:, None].expand(B, H, L)
    ref = torch.softmax(s, -1).nan_to_num(0.0) @ v.double().repeat_interleave(g, 1)
    out, lse = _native.decode(q, k, v, lo, hi, D ** -0.5, chunk=int(rng.choice([0, 64])))
    assert (out.double() - ref).abs().max().item() <= budget(torch.float32, D, S)
    assert torch.isneginf(lse[dead]).all() and not out[dead].any()
    if not dead.all():
        want = torch.logsumexp(s, -1)[~dead]
        assert (lse[~dead].double() - want).abs().max().item() <= budget(torch.float32, D, S) * 10
