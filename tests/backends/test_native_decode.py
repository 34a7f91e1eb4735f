"""The compiled kernel's decode entry (``_native.decode``, csrc/attn_decode.h) against the float64 golden.

A decode call is a few query rows (L <= 64) over a key/value cache: the g = H / Hkv query heads of a kv head are
packed as g·L rows, and the keys are split into chunks whose partial softmax states are merged exactly. Checked
here: every L / S / head layout of the brief (S around the 64-key tile and the 512-key chunk), built-in masks as
row intervals (bottom-right causal, windows, padding, rows that see nothing), strided caches read in place, bf16
and fp16 caches, rows of NaN, -inf and huge finite scores (as the forward treats them), each instruction set, one
and two threads (the same bits: the chunks depend on S only) and repeated calls (the same bits).

Error budget: the kernel widens bf16 / fp16 exactly and computes in fp32, so every dtype is held to conftest's
fp32 budget ``16 eps (sqrt(D) + sqrt(S))`` against float64 math on the same (rounded) inputs.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from conftest import assert_close, budget, golden, require_kernel
from test_native_kernel import instruction_set

from attnkit import masks as M
from attnkit.backends import _native

pytestmark = pytest.mark.skipif(os.environ.get("ATTNKIT_NATIVE", "1").lower() in ("0", "off", "false", "no"),
                                reason="the compiled kernel is switched off by ATTNKIT_NATIVE=0")


def _qkv(B, H, Hkv, L, S, D, Dv=None, dtype=torch.float32, gen=None):
    Dv = D if Dv is None else Dv
    g = gen or torch.Generator().manual_seed(B * 1000 + H * 100 + L * 10 + S)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _dense(lo, hi, B, L, S):
    j = torch.arange(S)
    lo, hi = lo.long().expand(B, L), hi.long().expand(B, L)
    return ((j >= lo[..., None]) & (j < hi[..., None]))[:, None]  # (B, 1, L, S), True = attend


def _golden(q, k, v, lo, hi):
    B, _, L, _ = q.shape
    return golden(q, k, v, mask=_dense(lo, hi, B, L, k.shape[2]))


def _check(q, k, v, lo, hi, what="", **kw):
    """decode vs the float64 golden: output, lse, and rows that see no key (out 0, lse -inf)."""
    out, lse = _native.decode(q, k, v, lo, hi, q.shape[-1] ** -0.5, **kw)
    ref, ref_lse = _golden(q, k, v, lo, hi)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    tol = budget(torch.float32, q.shape[-1], k.shape[2], max(1.0, v.abs().max().item()))
    assert_close(out, ref, tol, f"{what} out")
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live), f"{what}: lse is -inf exactly where a row sees no key"
    assert_close(lse[live], ref_lse[live], tol, f"{what} lse")
    assert (out[~live] == 0).all(), f"{what}: a row that sees no key gives out 0"
    return out, lse


def _intervals(kind, B, L, S):
    """(lo, hi) int32 of a decode step: bottom-right causal, a window with per-batch padding, or mixed with a
    row that sees nothing."""
    i = torch.arange(L)
    if kind == "causal":
        lo, hi = M.causal().row_intervals(B, L, S)
        return lo, hi
    if kind == "window_padding":  # batch row 0: window 300 over all keys; batch row 1: padded to 2/3 of S, window 40
        valid = torch.tensor([S, max(1, 2 * S // 3)])[:B, None]
        hi = (valid - L + 1 + i).clamp(min=0)
        lo = (hi - torch.tensor([300, 40])[:B, None]).clamp(min=0)
        return lo.int().contiguous(), hi.int().contiguous()
    lo = torch.zeros(B, L, dtype=torch.int32)
    hi = torch.full((B, L), S, dtype=torch.int32)
    hi[0, 0] = 0  # a dead row
    if L > 1:
        lo[-1, 1], hi[-1, 1] = S // 2, S // 2 + 1  # one key only
    return lo, hi


@pytest.mark.parametrize("L", [1, 3, 16])
@pytest.mark.parametrize("S", [1, 63, 64, 65, 1000, 5000])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_decode_matches_float64(L, S, H, Hkv):
    B, D = 2, 32
    q, k, v = _qkv(B, H, Hkv, L, S, D)
    for kind in ("causal", "window_padding", "dead_rows"):
        lo, hi = _intervals(kind, B, L, S)
        _check(q, k, v, lo, hi, f"{kind} L={L} S={S} H={H} Hkv={Hkv}")


@contextlib.contextmanager
def _order(order):
    """The decode's read order forced (-1 per call, 0 register-blocked, 1 memory order), restored after."""
    lib = _native._require()
    assert lib.ak_set_decode_order(order) == order
    try:
        yield
    finally:
        lib.ak_set_decode_order(-1)


@pytest.mark.parametrize("rows", range(1, 10))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_both_read_orders_give_the_same_bits_at_every_unit_size(rows, dtype):
    """Calls of K + V >= 8 MiB in units of 1..8 rows read K and V in memory order (dots_keys / pv_keys), the rest
    register-blocked: the same sums in the same order, so the same bits, at every unit size (9 rows: the
    register-blocked order either way), a head dim off the vector width (a summed tail), a value dim widened per
    tile, a strided cache; and within the budget of float64."""
    H, L = (rows, 1) if rows % 2 else (rows // 2, 2)
    for D, Dv in ((33, 17), (64, 64)):
        q, k, v = _qkv(2, H, 1, L, 300, D, Dv)
        big_k = torch.zeros(2, 1, 400, D + 3)
        big_k[:, :, :300, :D] = k
        k = big_k[:, :, :300, :D]  # a view into a bigger cache (row stride D + 3)
        if dtype is not torch.float32:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        lo, hi = _intervals("window_padding", 2, L, 300)
        with _order(0):
            blocked = _native.decode(q, k, v, lo, hi, D ** -0.5)
        with _order(1):
            streamed = _check(q, k, v, lo, hi, f"rows={rows} D={D} Dv={Dv} {dtype}")
        assert torch.equal(blocked[0], streamed[0]) and torch.equal(blocked[1], streamed[1]), (rows, D, dtype)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 64])
def test_bf16_decode_dot_products_within_the_fp32_budget(rows):
    """Where the CPU has avx512_bf16 (``_native.bf16_vdot()``), a bf16 decode takes its scores by VDPBF16PS: bf16
    products (exact in fp32) summed in fp32 in pairs, another order than the widening path's. Held to the same fp32
    budget against float64 on the same bf16 values, in both read orders, with head dims off 32 (a masked tail) and a
    strided cache, and its bits differ from the widening path's somewhere (the path ran); a unit whose q values pass
    the packing buffer (64 rows of D = 256) widens instead: the widening path's bits. Without avx512_bf16 the
    widening path, the same budget. (On a CPU with AMX, units of 2 to 16 rows take their scores on tiles instead:
    the same budget, other bits than the widening path's; the test below.)"""
    H, L = (rows, 1) if rows % 2 else (rows // 2, 2)
    for D in (33, 64, 200, 256):
        q, k, v = _qkv(2, H, 1, L, 700, D, dtype=torch.bfloat16)
        big_k = torch.zeros(2, 1, 800, D + 5, dtype=torch.bfloat16)
        big_k[:, :, :700, :D] = k
        k = big_k[:, :, :700, :D]  # a view into a bigger cache
        lo, hi = _intervals("window_padding", 2, L, 700)
        before = _native.set_bf16_dot(False)
        try:
            wide = _native.decode(q, k, v, lo, hi, D ** -0.5)
        finally:
            _native.set_bf16_dot(before)
        for order in (0, 1):
            with _order(order):
                got = _check(q, k, v, lo, hi, f"rows={rows} D={D} order={order}")
            packed = rows * -(-D // 32) * 32 <= 8192
            same = torch.equal(got[0], wide[0]) and torch.equal(got[1], wide[1])
            assert same == (not (_native.bf16_vdot() and packed)), (rows, D, order, same)


@pytest.mark.parametrize("g", [2, 4, 16])
def test_bf16_decode_scores_on_amx_tiles_within_the_fp32_budget(g):
    """On a CPU with AMX (``_native.bf16_dot()``) a bf16 decode unit of 2 to 16 rows (here a GQA group of g heads)
    takes its scores on tiles: 16 keys of K times the rows' q pairs, K copied zero-padded where fewer than 16 keys
    remain or D is not a multiple of 32. Held to the fp32 budget against float64 on the same bf16 values at head
    dims 1, 17, 80 and 128, caches of 1, 5, 77 and 131 keys (a last block of fewer than 16), a strided cache, both
    read orders (the same bits); an inf stored at a key no row sees stays out of the output. The tiles ran: each
    head's row computed alone (a unit of one row: VDPBF16PS) gives other bits somewhere; without AMX the same."""
    for D in (1, 17, 80, 128):
        for S in (1, 5, 77, 131):
            q, k, v = _qkv(1, g, 1, 1, S, D, dtype=torch.bfloat16)
            big_k = torch.zeros(1, 1, S + 3, D + 7, dtype=torch.bfloat16)
            big_k[:, :, :S, :D] = k
            k = big_k[:, :, :S, :D]  # a view into a bigger cache
            lo, hi = _intervals("causal", 1, 1, S)
            outs = []
            for order in (0, 1):
                with _order(order):
                    outs.append(_check(q, k, v, lo, hi, f"g={g} D={D} S={S} order={order}"))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (g, D, S)
            if S >= 5:  # an inf at the first key, which a window of the last 3 keys hides
                k2 = k.clone()
                k2[0, 0, 0, 0] = float("inf")
                lo3 = torch.full_like(lo, S - 3)
                got = _check(q, k2, v, lo3, hi, f"g={g} D={D} S={S} inf hidden")
                assert bool(torch.isfinite(got[0]).all()), (g, D, S)
    q, k, v = _qkv(1, g, 1, 1, 300, 64, dtype=torch.bfloat16)
    lo, hi = _intervals("causal", 1, 1, 300)
    together = _native.decode(q, k, v, lo, hi, 0.125)[0]
    alone = torch.cat([_native.decode(q[:, h:h + 1], k, v, lo, hi, 0.125)[0] for h in range(g)], 1)
    assert torch.equal(together, alone) == (not _native.bf16_dot()), g


@pytest.mark.parametrize("rows", [1, 4, 8, 9])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_caches_give_the_fp32_bits_of_their_widened_values(rows, dtype, widened_bf16):
    """A bf16 / fp16 cache below the memory-order size, widened (bf16's vector dot products off, as on a CPU without
    avx512_bf16): its scores at up to 8 rows a unit are the memory-order dot products (each key vector widened in a
    register), at 9 the register-blocked ones on a widened key block; either way the output and lse are the fp32
    call's on the widened values, bit for bit (the same sums in the same order), in both read orders, with a head dim
    off the vector width and a strided cache."""
    H, L = (rows, 1) if rows % 2 else (rows // 2, 2)
    for D in (33, 64):
        q, k, v = _qkv(2, H, 1, L, 700, D, dtype=dtype)
        big_k = torch.zeros(2, 1, 800, D + 5, dtype=dtype)
        big_k[:, :, :700, :D] = k
        k = big_k[:, :, :700, :D]  # a view into a bigger cache
        lo, hi = _intervals("window_padding", 2, L, 700)
        wide = _native.decode(q.float(), k.float(), v.float(), lo, hi, D ** -0.5)
        for order in (0, 1):
            with _order(order):
                got = _native.decode(q, k, v, lo, hi, D ** -0.5)
            what = (rows, D, dtype, order)
            assert torch.equal(got[0], wide[0]) and torch.equal(got[1], wide[1]), what


@pytest.mark.parametrize("D,Dv", [(8, 8), (33, 17), (64, 64), (80, 96), (128, 128)])
def test_head_dims(D, Dv):
    """Head dims off the vector width: the score's tail summed per key, V tiles padded per tile."""
    q, k, v = _qkv(2, 8, 2, 3, 700, D, Dv)
    lo, hi = _intervals("window_padding", 2, 3, 700)
    _check(q, k, v, lo, hi, f"D={D} Dv={Dv}")


def test_built_in_masks_as_intervals():
    """The masks a generation step uses, through ``row_intervals`` (shared by the batch, lob = 0, or per row)."""
    B, H, Hkv, L, S, D = 2, 8, 2, 4, 1500, 64
    q, k, v = _qkv(B, H, Hkv, L, S, D)
    for mask in (None, M.causal(), M.sliding_window(128), M.causal() & M.padding([S, 900]),
                 M.sliding_window(64) & M.padding([1000, 20]), M.padding([0, S])):
        lo, hi = (M.full() if mask is None else mask).row_intervals(B, L, S)
        out, lse = _check(q, k, v, lo, hi, repr(mask))
        ref, ref_lse = golden(q, k, v, mask=mask)
        assert_close(out, ref, budget(torch.float32, D, S), f"{mask!r} vs the mask itself")
        assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), repr(mask)


def test_strided_caches_are_read_in_place():
    """A view into a bigger preallocated cache (B, Hkv, Smax, D), and a (B, Smax, Hkv, D) cache seen as
    (B, Hkv, S, D) (heads not contiguous, rows Hkv·D apart): read at their strides, never copied."""
    B, H, Hkv, L, S, Smax, D = 2, 8, 2, 3, 1100, 1600, 64
    q, _, _ = _qkv(B, H, Hkv, L, S, D)
    big_k, big_v = torch.randn(B, Hkv, Smax, D), torch.randn(B, Hkv, Smax, D)
    k, v = big_k[:, :, :S], big_v[:, :, :S]
    assert not k.is_contiguous()
    lo, hi = _intervals("causal", B, L, S)
    _check(q, k, v, lo, hi, "preallocated (B, Hkv, Smax, D)")
    bsk, bsv = torch.randn(B, Smax, Hkv, D), torch.randn(B, Smax, Hkv, D)
    k, v = bsk[:, :S].transpose(1, 2), bsv[:, :S].transpose(1, 2)
    assert k.stride() == (Smax * Hkv * D, D, Hkv * D, 1)
    _check(q, k, v, lo, hi, "(B, Smax, Hkv, D) transposed")
    qs = torch.randn(B, L, H, D).transpose(1, 2)  # queries (B, L, H, D) as (B, H, L, D)
    _check(qs, k, v, lo, hi, "transposed queries")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_low_precision_caches(dtype, H, Hkv):
    """bf16 / fp16 q, k, v widened in registers (exactly): the fp32 budget against float64 on the same values;
    fp16 subnormals, the largest finite values and signed zeros included."""
    B, L, S, D = 2, 3, 1300, 64
    q, k, v = _qkv(B, H, Hkv, L, S, D, dtype=dtype)
    if dtype == torch.float16:
        special = torch.tensor([6e-8, -6e-8, 1e-5, -3e-5, 65504.0, -65504.0, 0.0, -0.0] * 2 + [1.0] * 4, dtype=dtype)
        v[0, 0, :20, 0] = special
        k[0, 0, 20:40, 1] = special / 8192  # subnormal and tiny key entries (scores stay O(1))
    lo, hi = _intervals("window_padding", B, L, S)
    _check(q, k, v, lo, hi, f"{dtype}")
    strided = torch.randn(B, Hkv, S + 100, D).to(dtype)[:, :, :S]
    _check(q, strided, v, lo, hi, f"{dtype} strided")


def test_nan_inf_and_huge_rows_as_the_forward():
    """A query row of NaN gives NaN on that row; a NaN key gives NaN on the rows that see it and nothing on the
    others; a -inf query row gives what the forward gives; a row whose scores are all a huge finite negative
    (finfo.min / 8: identical keys) is the mean of its V rows, lse = score + log(n). Same finiteness pattern as
    the forward on the same inputs, in fp32 and bf16 (NaN and inf survive the widening)."""
    B, H, Hkv, L, S, D = 2, 8, 2, 3, 1200, 32
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = _qkv(B, H, Hkv, L, S, D, dtype=dtype)
        q[0, 1, 0] = float("nan")
        q[0, 5, 2] = float("-inf")
        k[1, 1, 700] = float("nan")
        lo, hi = _intervals("causal", B, L, S)
        lo = lo.expand(B, L).contiguous()
        hi = hi.expand(B, L).contiguous()
        hi[1, 0] = 600  # batch row 1, row 0 does not see key 700
        out, lse = _native.decode(q, k, v, lo, hi, D ** -0.5)
        fo, fl, _ = _native.forward(q.float(), k.float(), v.float(), lo, hi, D ** -0.5)
        assert torch.equal(torch.isnan(out), torch.isnan(fo)), f"{dtype}: NaN where the forward has NaN"
        assert torch.equal(torch.isnan(lse), torch.isnan(fl)) and torch.equal(torch.isinf(lse), torch.isinf(fl))
        assert torch.isnan(out[0, 1, 0]).all() and torch.isnan(out[1, 4:8, 1:]).all()
        assert torch.isfinite(out[1, 4:8, 0]).all(), "a row that does not see the NaN key stays finite"
        ok = torch.isfinite(fo)
        assert_close(out[ok], fo[ok], budget(torch.float32, D, S), f"{dtype}: the finite rows as the forward")
    # all scores of a row equal and huge negative: the mean of the V rows it sees
    q, k, v = _qkv(1, 4, 1, 1, 3000, D)
    u = torch.randn(D)
    k[:] = -u
    q[0, 2, 0] = u * (torch.finfo(torch.float32).max / 8 / (u @ u) / D ** -0.5)  # q.k itself finite in fp32
    lo, hi = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), 2500, dtype=torch.int32)
    out, lse = _native.decode(q, k, v, lo, hi, D ** -0.5)
    assert_close(out[0, 2, 0], v[0, 0, :2500].double().mean(0), budget(torch.float32, D, 2500), "finfo.min row")
    s = (q[0, 2, 0] @ k[0, 0, 0]) * D ** -0.5
    assert torch.isfinite(s) and s < -1e37 and torch.isfinite(q[0, 2, 0] @ k[0, 0, 0])
    assert abs(lse[0, 2, 0].item() - (s.item() + torch.log(torch.tensor(2500.0)).item())) <= abs(s.item()) * 1e-6


@pytest.mark.parametrize("isa", ["base", "avx2", "avx512"])
def test_every_instruction_set(isa):
    with instruction_set(isa):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for (H, Hkv, L, S, D) in ((4, 4, 1, 1000, 24), (8, 2, 3, 700, 40), (8, 1, 16, 65, 33)):
                q, k, v = _qkv(2, H, Hkv, L, S, D, dtype=dtype)
                lo, hi = _intervals("window_padding", 2, L, S)
                for order in (0, 1):  # register-blocked, memory order (units of <= 8 rows)
                    with _order(order):
                        _check(q, k, v, lo, hi, f"{isa} {dtype} H={H} Hkv={Hkv} L={L} S={S} D={D} order={order}")


def test_same_bits_at_one_and_two_threads_and_on_every_call():
    """Chunks depend on S only, and are merged in chunk order: the same bits at any thread count, every call."""
    B, H, Hkv, L, S, D = 2, 8, 2, 3, 5000, 64
    q, k, v = _qkv(B, H, Hkv, L, S, D)
    lo, hi = _intervals("window_padding", B, L, S)
    saved = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2, 1, 2):
            torch.set_num_threads(t)
            runs.append(_native.decode(q, k, v, lo, hi, D ** -0.5))
            runs.append(_native.decode(q, k, v, lo, hi, D ** -0.5))
    finally:
        torch.set_num_threads(saved)
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


@pytest.mark.parametrize("chunk", [64, 128, 576, 4096])
def test_explicit_chunk_sizes(chunk):
    """Any chunk (a multiple of 64) gives the same function within the budget: the lse merge is exact."""
    q, k, v = _qkv(2, 8, 2, 16, 3000, 32)
    lo, hi = _intervals("window_padding", 2, 16, 3000)
    _check(q, k, v, lo, hi, f"chunk {chunk}", chunk=chunk)


def test_many_rows_span_several_units():
    """g·L > 64 rows per kv head (L = 64, g = 4): the rows are cut into units of 64, each reading K / V."""
    q, k, v = _qkv(1, 4, 1, 64, 900, 32)
    lo, hi = _intervals("causal", 1, 64, 900)
    _check(q, k, v, lo, hi, "L=64 g=4")


def test_without_lse_and_the_signature_cache():
    """need_lse=False returns None for lse and the same output; a new S, new strides and new tensors reuse the
    prepared record of the signature (only the per-step block is rewritten) and stay exact."""
    B, H, Hkv, L, D = 1, 8, 2, 1, 64
    cache_k, cache_v = torch.randn(B, Hkv, 4000, D), torch.randn(B, Hkv, 4000, D)
    q = torch.randn(B, H, L, D)
    for S in (10, 11, 700, 3999):
        k, v = cache_k[:, :, :S], cache_v[:, :, :S]
        lo, hi = torch.zeros(1, L, dtype=torch.int32), torch.full((1, L), S, dtype=torch.int32)
        out, _ = _check(q, k, v, lo, hi, f"S={S}")
        out2, none = _native.decode(q, k, v, lo, hi, D ** -0.5, need_lse=False)
        assert none is None and torch.equal(out, out2)
        _check(q, k.contiguous(), v.contiguous(), lo, hi, f"S={S} contiguous")


def test_an_empty_cache_gives_dead_rows():
    q, k, v = _qkv(2, 4, 2, 3, 0, 16)
    lo, hi = torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32)
    out, lse = _native.decode(q, k, v, lo, hi, 0.25)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_bad_arguments_are_refused_with_the_reason():
    q, k, v = _qkv(1, 6, 4, 1, 10, 8)
    lo, hi = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="H a multiple of Hkv"):
        _native.decode(q, k, v, lo, hi, 1.0)
    q, k, v = _qkv(1, 4, 4, 65, 10, 8)
    lo, hi = torch.zeros(1, 65, dtype=torch.int32), torch.full((1, 65), 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="L = 65"):
        _native.decode(q, k, v, lo, hi, 1.0)
    q, k, v = _qkv(1, 4, 4, 1, 10, 8)
    lo, hi = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), 10, dtype=torch.int32)
    with pytest.raises(TypeError, match="share one dtype"):
        _native.decode(q, k.half(), v, lo, hi, 1.0)
    with pytest.raises(ValueError, match="int32"):
        _native.decode(q, k, v, lo.long(), hi, 1.0)
    with pytest.raises(ValueError, match="contiguous last dim"):
        _native.decode(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, lo, hi, 1.0)
    with pytest.raises(ValueError, match="multiple of 64"):
        _native.decode(q, k, v, lo, hi, 1.0, chunk=100)
    with pytest.raises(ValueError, match="CPU tensors"):
        _native.decode(q, k.to("meta"), v, lo, hi, 1.0)


@pytest.mark.parametrize("entry", ["forward", "decode"])
def test_a_prepared_call_gives_the_same_bits_through_the_vectorcall_and_ctypes(entry, monkeypatch):
    """A replayed call's hot path: the extension's ``step`` (one vectorcall writes the record's per-call slots and
    runs the entry) and the ctypes fallback (a build without it) give the same bits, the golden's within budget,
    on calls of other strides and scales than the prepared one."""
    require_kernel()
    assert _native._ext is not None  # this build has the vectorcalls
    B, H, Hkv, L, S, D = 2, 4, 2, 3, 200, 16
    q, k, v = _qkv(B, H, Hkv, L, S, D)
    lo = torch.zeros(1, L, dtype=torch.int32)
    hi = torch.arange(S - L + 1, S + 1, dtype=torch.int32)[None]  # bottom-right causal
    make = _native.forward_step if entry == "forward" else _native.decode_step
    with_ext = make(q, k, v, lo, hi)
    monkeypatch.setattr(_native, "_ext", None)
    with_ctypes = make(q, k, v, lo, hi)
    ref, _ = _golden(q.double(), k.double(), v.double(), lo, hi)
    for scale, kt in ((D ** -0.5, k), (0.3, k.transpose(1, 2).contiguous().transpose(1, 2))):
        a = with_ext(q, kt, v, scale)
        b = with_ctypes(q, kt, v, scale)
        assert torch.equal(a, b), (entry, scale)
        if scale == D ** -0.5:
            assert_close(a, ref, budget(torch.float32, D, S), entry)


def _stepper_pair(make, *args, **kw):
    """A prepared call as the extension's C ``Stepper`` and as its Python fallback (the same record)."""
    step = make(*args, **kw)
    assert type(step).__name__ == "Stepper", "a build of the kernel without the C stepper: rebuild it"
    return step, step.fallback


@pytest.mark.parametrize("entry", ["forward", "decode"])
@pytest.mark.parametrize("outputs, dtype", [(o, d) for o in ("out", "lse", "beside")
                                            for d in (torch.float32, torch.bfloat16, torch.float16)
                                            if not (o == "beside" and d is torch.float32)])  # (fp32: nothing beside)
def test_the_c_stepper_gives_the_python_steppers_bits(entry, dtype, outputs):
    """A replayed call's per-call work in C (``Stepper``: checks, strides, pointers, outputs, the record copied per
    call) gives the same bits as the Python stepper it falls back to, and the golden within budget: every output
    form (out; out and lse; fp32 out, lse and out rounded beside), every dtype, strided K / V (read in place), other
    scales."""
    require_kernel()
    B, H, Hkv, L, S, D = 2, 4, 2, 3, 200, 16
    q, k, v = (t.to(dtype) for t in _qkv(B, H, Hkv, L, S, D))
    lo = torch.zeros(1, L, dtype=torch.int32)
    hi = torch.arange(S - L + 1, S + 1, dtype=torch.int32)[None]  # bottom-right causal
    make = _native.forward_step if entry == "forward" else _native.decode_step
    kw = dict(with_lse=outputs != "out", beside=outputs == "beside", rounded=outputs == "out")
    c_step, py_step = _stepper_pair(make, q, k, v, lo, hi, **kw)
    ref, ref_lse = _golden(q.double(), k.double(), v.double(), lo, hi)
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)  # (B, Hkv, S, D) with heads and rows swapped in memory
    for scale, kk in ((D ** -0.5, k), (0.3, kt)):
        a, b = c_step(q, kk, v, scale), py_step(q, kk, v, scale)
        a, b = (a,) if outputs == "out" else a, (b,) if outputs == "out" else b
        assert len(a) == len(b) == {"out": 1, "lse": 2, "beside": 3}[outputs]
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape and x.is_contiguous()
            assert torch.equal(x, y), (entry, dtype, outputs, scale)
        assert a[0].dtype == (dtype if outputs == "out" else torch.float32)
        if scale == D ** -0.5:
            tol = budget(dtype, D, S)  # (bf16 / fp16: the forward multiplies in the input dtype where it can)
            assert_close(a[0].double(), ref, tol, entry)
            if outputs != "out":
                assert_close(a[1].double(), ref_lse, tol, entry)
            if outputs == "beside":
                assert torch.equal(a[2], a[0].to(dtype))


def test_the_c_stepper_takes_each_calls_rows_and_any_cache_length():
    """The decode stepper in C: a call's own rows as tensors of the prepared shape, or one interval for every row
    as two ints, and any cache length S (a decode loop's next step) — the Python stepper's bits, the golden's
    values."""
    require_kernel()
    B, H, Hkv, L, D = 1, 8, 2, 4, 32
    q, k, v = _qkv(B, H, Hkv, L, 300, D)
    lo = torch.zeros(1, L, dtype=torch.int32)
    hi = torch.full((1, L), 300, dtype=torch.int32)
    c_step, py_step = _stepper_pair(_native.decode_step, q, k, v, lo, hi)
    for S in (300, 301, 64, 1000):
        kS, vS = (t[:, :, :S] if S <= 300 else torch.randn(B, Hkv, S, D) for t in (k, v))
        rows = (torch.arange(L, dtype=torch.int32)[None] * 3, torch.full((1, L), S - 1, dtype=torch.int32))
        for given in ((), rows, (2, S - 5)):
            a, b = c_step(q, kS, vS, 0.25, *given), py_step(q, kS, vS, 0.25, *given)
            assert torch.equal(a, b), (S, given)
            glo, ghi = given if given else (lo, hi.clamp(max=S))  # (the prepared rows: the kernel clamps to S)
            if given and type(given[0]) is int:
                glo, ghi = torch.full((1, L), given[0], dtype=torch.int32), torch.full((1, L), given[1],
                                                                                       dtype=torch.int32)
            ref, _ = golden(q.double(), kS.double(), vS.double(), mask=_dense(glo, ghi, B, L, S), scale=0.25)
            assert_close(a, ref, budget(torch.float32, D, S), (S, given))
    # an interval's bounds past int32 are saturated, as the kernel clamps any bound to [0, S] (ctypes had wrapped
    # 2**32 + 5 to 5: five keys attended, not all), in C and in Python alike
    every = c_step(q, k, v, 0.25, 0, 300)
    for lo_, hi_ in ((0, 2**32 + 5), (-(2**40), 2**70), (-5, 2**31)):
        for step in (c_step, py_step):
            assert torch.equal(step(q, k, v, 0.25, lo_, hi_), every), (lo_, hi_)


def test_the_c_stepper_hands_what_it_was_not_prepared_for_to_the_python_stepper():
    """What the C stepper does not take goes to the Python stepper, which fits it or names it: a last stride other
    than 1 (copied, the same bits as the contiguous call), another dtype (TypeError), another S for the forward
    (ValueError), lo / hi of another shape or dtype (ValueError), keywords; and it is never a crash."""
    require_kernel()
    B, H, Hkv, L, S, D = 1, 4, 2, 2, 70, 16
    q, k, v = _qkv(B, H, Hkv, L, S, D)
    lo, hi = torch.zeros(1, L, dtype=torch.int32), torch.full((1, L), S, dtype=torch.int32)
    fwd, _ = _stepper_pair(_native.forward_step, q, k, v, lo, hi)
    dec, _ = _stepper_pair(_native.decode_step, q, k, v, lo, hi)
    for step in (fwd, dec):
        qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last stride L, not 1
        assert qt.stride(-1) != 1
        assert torch.equal(step(qt, k, v, 0.5), step(q, k, v, 0.5))
        with pytest.raises(TypeError, match=r"prepared for torch\.float32"):
            step(q.double(), k.double(), v.double(), 0.5)
        assert torch.equal(step(q, k, v, scale=0.5), step(q, k, v, 0.5))  # keywords: the Python stepper
    with pytest.raises(ValueError, match="prepared for S = 70"):
        fwd(q, k[:, :, :60], v[:, :, :60], 0.5)
    with pytest.raises(ValueError, match="prepared for S = 70"):
        fwd(q, k, v[:, :, :60], 0.5)
    for bad in (lo.long(), lo[:, :1], lo.expand(2, L), torch.zeros(1, 2 * L, dtype=torch.int32)[:, ::2]):
        with pytest.raises(ValueError, match="lo / hi must be contiguous int32"):
            dec(q, k, v, 0.5, bad, hi)
    with pytest.raises(TypeError):
        dec(q, k, v, "half")
    with pytest.raises(TypeError):
        dec(q, k, v)
    with pytest.raises(TypeError, match="23 arguments"):
        _native._ext.stepper(b"", 0)
    with pytest.raises(ValueError, match="another size"):
        _native._ext.stepper(b"x", *([0] * 13), *([None] * 9))
    with pytest.raises(TypeError, match="cannot create"):  # only stepper() makes one (its record filled)
        type(dec)()


def test_the_c_stepper_serves_threads_at_once_and_keeps_no_reference():
    """The record is copied onto each call's own stack (no per-thread state): threads calling one stepper at once
    get each their own call's bits; and a call leaves no reference behind (its outputs are the caller's alone)."""
    import sys
    import threading

    require_kernel()
    B, H, Hkv, L, S, D = 1, 8, 2, 1, 500, 64
    q, k, v = _qkv(B, H, Hkv, L, S, D)
    lo, hi = torch.zeros(1, L, dtype=torch.int32), torch.full((1, L), S, dtype=torch.int32)
    step, py_step = _stepper_pair(_native.decode_step, q, k, v, lo, hi, with_lse=True)
    inputs = [(torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)) for _ in range(4)]
    want = [py_step(*t, 0.125) for t in inputs]
    bad: list = []

    def work(i):
        for _ in range(50):
            out, lse = step(*inputs[i], 0.125)
            if not (torch.equal(out, want[i][0]) and torch.equal(lse, want[i][1])):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    before = (sys.getrefcount(torch.float32), sys.getrefcount(torch.empty), sys.getrefcount(q))
    for _ in range(200):
        out, lse = step(q, k, v, 0.125)
    assert sys.getrefcount(out) == 2 and sys.getrefcount(lse) == 2  # (the name and getrefcount's argument)
    del out, lse
    assert (sys.getrefcount(torch.float32), sys.getrefcount(torch.empty), sys.getrefcount(q)) == before


@pytest.mark.parametrize("dtype, Hkv, g", [(torch.float32, 2, 1), (torch.bfloat16, 4, 4)])
def test_the_read_order_is_learned_where_the_rule_would_stream(dtype, Hkv, g):
    """Where a record leaves the read order to the rule and the rule would read K and V in memory order (from 8 MB,
    units of up to 8 rows), the kernel learns the order per call shape: the first call untimed, then both orders
    timed in turn, three of each, and the faster kept. Every call gives the same bits whichever order ran (the forced
    orders' bits), the shape is decided after seven calls, a second shape learns on its own, and a record that names
    its order (this machine's calibration) or learning switched off learns nothing."""
    require_kernel()
    lib = _native._require()
    before = _native.set_read_order_learning(True, forget=True)
    try:
        D, S = 64, 20000  # K and V: Hkv * S * 2D elements, 10-20 MB
        q, k, v = _qkv(1, Hkv * g, Hkv, 1, S, D, dtype=dtype)
        lo, hi = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), S, dtype=torch.int32)
        outs = [_native.decode(q, k, v, lo, hi, 0.125, order="rule")[0] for _ in range(6)]
        assert _native.learned_read_orders()[0] == 0  # (six calls: the warm-up and five timings)
        outs.append(_native.decode(q, k, v, lo, hi, 0.125, order="rule")[0])
        assert _native.learned_read_orders()[0] == 1
        for forced in (0, 1):
            lib.ak_set_decode_order(forced)
            try:
                outs.append(_native.decode(q, k, v, lo, hi, 0.125, order="rule")[0])
            finally:
                lib.ak_set_decode_order(-1)
        assert all(torch.equal(o, outs[0]) for o in outs)
        k2, v2 = k[:, :, : S // 2 + 5000], v[:, :, : S // 2 + 5000]  # another power of two of bytes: its own shape
        for _ in range(7):
            _native.decode(q, k2, v2, lo, hi.clamp(max=k2.shape[2]), 0.125, order="rule")
        assert _native.learned_read_orders()[0] == 2
        _native.set_read_order_learning(True, forget=True)
        for order in ("blocked", "memory"):
            for _ in range(5):
                _native.decode(q, k, v, lo, hi, 0.125, order=order)
        _native.set_read_order_learning(False)
        for _ in range(5):
            _native.decode(q, k, v, lo, hi, 0.125, order="rule")
        assert _native.learned_read_orders() == (0, 0)
    finally:
        _native.set_read_order_learning(before, forget=True)


def test_the_vectorcalls_refuse_a_bad_record_or_entry():
    """``step`` is internal, but a wrong argument is a Python error naming what it expected, never a crash."""
    require_kernel()
    ext = _native._ext
    with pytest.raises(ValueError, match="null record"):
        ext.step(0, 0, 0)
    with pytest.raises(ValueError, match="entry other than 0 / 2"):
        ext.step(1, 8, 0)
    with pytest.raises(ValueError, match="slots outside it"):
        ext.step(0, 8, 10_000, 1)
    with pytest.raises(TypeError, match="3 to 35 ints"):
        ext.step(0)
    with pytest.raises(TypeError, match="11 ints"):
        ext.suspect_rows(0, 0)
    with pytest.raises(TypeError):
        ext.suspect_rows(*([None] * 11))


def test_step_refuses_slots_past_the_record_even_where_the_sum_overflows():
    """(Review finding 3) ``first + n`` past the record is refused even where ``first`` is near 2**63 (the sum
    overflowed and passed the check, writing before the buffer)."""
    import ctypes

    require_kernel()
    buf = (ctypes.c_int64 * 64)()
    for first in (2**63 - 1, 2**63 - 2, 10_000):
        with pytest.raises(ValueError, match="slots outside it"):
            _native._ext.step(2, ctypes.addressof(buf), first, 7)
