"""score_mods on the compiled kernel's decode entry: a few query rows over a cache with a traced score_mod (Gemma 2's
soft cap, T5's buckets, tables read by index) or ALiBi's slopes, as :mod:`test_native_score_mod` checks the forward.

A decode step with a score_mod used to leave the decode entry for the forward kernel (a 64-row query block for one
row, the cache read once per query head instead of once per group: 4.4x the read against 1.1-1.2x with a mask
alone). Checked here: attention-gym's mods (``gym_score_mods``) at decode sizes, dispatch naming the decode entry
and the program, MHA and GQA, L = 1 / 3 / 16, S around the 64-key tile and the split-K chunk, dead rows, bf16
caches, both read orders (the same bits), every instruction set, an out-of-range read raising IndexError, and a
captured tensor edited in place between the steps of a decode loop.

Error budget: conftest's fp32 budget ``16 eps (sqrt(D) + sqrt(S))`` for the dot products and the softmax, plus the
modified score's own rounding: a score of magnitude M is rounded to within eps·M at each of a few operations, and an
error of δ in a score moves the output by at most ~δ·max|v|: ``8 eps M max|v|``. M is measured on the float64
scores (ALiBi over 2000 keys reaches M ~ 1000).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_close, budget, golden
from test_native_decode import _order
from test_native_kernel import instruction_set
from test_native_score_mod import gym_score_mods

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM

pytestmark = pytest.mark.skipif(os.environ.get("ATTNKIT_NATIVE", "1").lower() in ("0", "off", "false", "no"),
                                reason="the compiled kernel is switched off by ATTNKIT_NATIVE=0")

EPS32 = torch.finfo(torch.float32).eps


def _qkv(B, H, Hkv, L, S, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + 7 * S + L)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _largest_score(q, k, mod) -> float:
    """max |mod(q.k / sqrt(D))| in float64 over every (b, h, q, kv) (the mod applied to broadcast indices)."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if S == 0:
        return 0.0
    kk = k.double().repeat_interleave(H // Hkv, 1)
    s = q.double() @ kk.transpose(-1, -2) * D ** -0.5
    if mod is not None:
        idx = (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1), torch.arange(L).view(1, 1, L, 1),
               torch.arange(S).view(1, 1, 1, S))
        s = mod(s, *idx)
    return s.abs().max().item()


def _check(q, k, v, mask, mod, what="", reason="program"):
    """attention through attnkit (which runs the decode entry: asserted) against the float64 golden."""
    d = attnkit.dispatch(q, k, v, mask=mask, score_mod=mod)
    assert d.worker == "native" and "decode entry" in d.worker_reason and reason in d.worker_reason, (what, d)
    out, lse = attnkit.attention(q, k, v, mask=mask, score_mod=mod, return_lse=True)
    ref, ref_lse = golden(q, k, v, mask=mask, score_mod=mod)
    vmax = max(1.0, v.double().abs().max().item()) if v.numel() else 1.0
    tol = budget(torch.float32, q.shape[-1], k.shape[2], vmax) + 8 * EPS32 * _largest_score(q, k, mod) * vmax
    assert out.dtype == q.dtype
    assert_close(out.float(), ref, tol if q.dtype == torch.float32 else tol + EPS[q.dtype] * vmax, f"{what} out")
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live), f"{what}: lse is -inf exactly where a row sees no key"
    assert_close(lse[live], ref_lse[live], tol, f"{what} lse")
    assert (out[~live] == 0).all(), f"{what}: a row that sees no key gives out 0"
    return out


EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # the output's own rounding to its dtype

SIZES = [(1, 1), (1, 63), (1, 700), (3, 2000), (16, 300)]
MOD_NAMES = sorted(gym_score_mods(H=4, L=4))  # (T5's table has 4 heads)


@pytest.mark.parametrize("name", MOD_NAMES)
@pytest.mark.parametrize("L,S", SIZES, ids=[f"L{L}_S{S}" for L, S in SIZES])
def test_gym_score_mods_at_decode_match_float64(name, L, S):
    mod = gym_score_mods(H=4, L=S)[name]  # tables sized for kv - q in (-S, S)
    for H, Hkv in ((4, 4), (4, 1)):
        q, k, v = _qkv(2, H, Hkv, L, S, 24)
        for mask in (M.causal(), None, M.sliding_window(40)):
            _check(q, k, v, mask, mod, f"{name} H={H} Hkv={Hkv} mask={mask!r}")


def test_alibi_with_fixed_slopes_adds_its_bias_in_the_decode_entry():
    H, S = 8, 2000
    mod = SM.alibi(attnkit.positional.alibi_slopes(H))
    for Hkv, L in ((8, 1), (2, 3)):
        q, k, v = _qkv(1, H, Hkv, L, S, 64)
        _check(q, k, v, M.causal(), mod, f"alibi Hkv={Hkv} L={L}", reason="ALiBi")


def test_dead_rows_padding_and_bf16_caches():
    """Per-batch padding (batch row 1 sees only its first 500 keys; one batch row sees none), in fp32 and bf16."""
    mod = SM.softcap(5.0)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = _qkv(3, 8, 2, 2, 1500, 32, dtype=dtype)
        _check(q, k, v, M.padding([1500, 500, 0]), mod, f"padding {dtype}")


def test_both_read_orders_give_the_same_bits_with_a_program():
    """K + V of at least 8 MiB read in memory order, smaller calls register-blocked: the program runs on the same
    scores either way (the same bits), across split-K chunks of a long cache."""
    mods = gym_score_mods(H=4, L=20000)
    q, k, v = _qkv(1, 4, 1, 1, 20000, 64)
    for name in ("softcap", "t5_buckets", "relative_table", "alibi_lambda"):
        outs = []
        for order in (0, 1):
            with _order(order):
                outs.append(_check(q, k, v, M.causal(), mods[name], f"{name} order={order}"))
        assert torch.equal(outs[0], outs[1]), name


@pytest.mark.parametrize("isa", ["base", "avx2", "avx512"])
def test_every_instruction_set(isa):
    mods = gym_score_mods(H=4, L=700)
    with instruction_set(isa):
        for name in ("softcap", "t5_buckets", "exp_log", "clamp_minmax", "document_bias"):
            q, k, v = _qkv(2, 4, 2, 3, 700, 40)
            _check(q, k, v, M.causal(), mods[name], f"{isa} {name}")


def test_an_index_out_of_range_raises_index_error_as_torch_does():
    t = torch.randn(100)
    mod = lambda s, b, h, q, kv: s + t[kv]  # noqa: E731  # 300 keys, a table of 100
    q, k, v = _qkv(1, 4, 2, 1, 300, 16)
    d = attnkit.dispatch(q, k, v, score_mod=mod)
    assert "decode entry" in d.worker_reason, d
    for _ in range(2):  # the first call and the prepared one after it
        with pytest.raises(IndexError, match=r"shape \(100,\)"):
            attnkit.attention(q, k, v, score_mod=mod)
    t2 = torch.randn(300)  # large enough: the same call runs
    _check(q, k, v, None, lambda s, b, h, q, kv: s + t2[kv], "in range")


def test_a_captured_tensor_edited_in_place_between_steps_is_followed():
    """A decode loop whose score_mod reads a per-key bias that the caller edits between steps: every step (the
    first, then the prepared calls) reads the bias as it is then."""
    S = 400
    bias = torch.zeros(S)
    mod = lambda s, b, h, q, kv: s + bias[kv]  # noqa: E731
    q, k, v = _qkv(1, 8, 2, 1, S, 32)
    for step in range(4):
        _check(q, k, v, M.causal(), mod, f"step {step}")
        bias[torch.randint(0, S, (50,))] += 3.0 * (step + 1)
