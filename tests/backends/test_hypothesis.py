"""Property test: random shapes, masks and options; every backend equals the float64 golden."""

from __future__ import annotations

import torch
from conftest import assert_close, budget, golden
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks, score_mods


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.sampled_from([1, 2]))
    H = Hkv * draw(st.sampled_from([1, 2, 3]))
    L = draw(st.sampled_from([1, 2, 17, 97, 129]))
    S = draw(st.sampled_from([1, 3, 17, 97, 129]))
    D = draw(st.sampled_from([16, 59, 64]))
    Dv = draw(st.sampled_from([D, 24]))
    kind = draw(st.sampled_from(["none", "causal", "top_left", "window", "padding", "prefix", "band", "combo"]))
    w = draw(st.integers(1, 40))
    mask = {
        "none": None,
        "causal": masks.causal(),
        "top_left": masks.causal("top_left"),
        "window": masks.sliding_window(w),
        "padding": masks.padding([draw(st.integers(0, S)) for _ in range(B)]),
        "prefix": masks.prefix_lm(min(w, S)),
        "band": masks.from_mod(lambda b, h, q, kv: (q - kv).abs() < w),
        "combo": (masks.sliding_window(w) | masks.prefix_lm(min(2, S))) & ~masks.from_mod(lambda b, h, q, kv: kv == 0),
    }[kind]
    mod = draw(st.sampled_from([None, "softcap", "alibi"]))
    score_mod = {None: None, "softcap": score_mods.softcap(4.0),
                 "alibi": score_mods.alibi(torch.linspace(0.5, 0.01, H))}[mod]
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**16))
    return (B, H, Hkv, L, S, D, Dv), mask, score_mod, dtype, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_all_backends_match_golden(problem):
    (B, H, Hkv, L, S, D, Dv), mask, score_mod, dtype, seed = problem
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=g, dtype=torch.float64).to(dtype)
    ref, ref_lse = golden(q, k, v, mask=mask, score_mod=score_mod)
    backends = ["eager", "auto", "tiled"] + ([] if score_mod else ["sdpa"])
    finite = torch.isfinite(ref_lse)
    for backend in backends:
        if backend in ("eager", "tiled"):  # lse as well ("auto" and "sdpa" keep the no-lse route)
            out, lse = attnkit.attention(q, k, v, mask=mask, score_mod=score_mod, backend=backend, return_lse=True)
            assert torch.equal(torch.isfinite(lse), finite), f"{backend} {mask!r}: lse -inf pattern differs"
            assert_close(lse[finite], ref_lse[finite], budget(dtype, D, S) * 4, f"{backend} {mask!r} lse")
        else:
            out = attnkit.attention(q, k, v, mask=mask, score_mod=score_mod, backend=backend)
        assert_close(out, ref, budget(dtype, D, S), f"{backend} {mask!r}")
