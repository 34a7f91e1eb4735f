"""The compiled kernel with gradients at a few query rows (L <= 16): the forward runs on the decode entry (the g query
heads of a kv head packed as rows, K / V read once per group), the backward on those rows as one unit per kv head
(csrc/attn_decode.h's rows_backward; a learnable table of a score_mod keeps the key-tile backward). Every case
against float64 (outputs, lse, dq / dk / dv, a learnable table's gradient; score_mods as the kernel's programs), within
the fp32 budget; the route itself (the decode entry, not the forward's query block of 64 columns) checked by counting
the kernel's calls; the forward's own blocks of fewer than 64 rows (L = 17 and the last block of L = 70) too."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, budget, rand_qkv, require_kernel
from test_native_kernel import instruction_set

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM
from attnkit.backends import _native

pytestmark = pytest.mark.usefixtures("kernel")


@pytest.fixture
def kernel():
    require_kernel()


@pytest.fixture
def calls(monkeypatch):
    """Counts of the kernel's decode entry and forward calls made through ``_native``."""
    n = {"decode": 0, "forward": 0}
    dec, fwd = _native.decode, _native.forward

    def decode(*a, **kw):
        n["decode"] += 1
        return dec(*a, **kw)

    def forward(*a, **kw):
        n["forward"] += 1
        return fwd(*a, **kw)

    monkeypatch.setattr(_native, "decode", decode)
    monkeypatch.setattr(_native, "forward", forward)
    return n


def _check(q, k, v, lse_grad=True, leaves=(), tol_scale=1.0, **kw):
    """Kernel (backend="tiled") against the eager path in float64 (the reference's math, with autograd): out, lse,
    and the gradients of (out * go).sum() + (lse * gl).sum() into q, k, v and ``leaves``."""
    D, S = q.shape[-1], k.shape[2]
    out, lse = attnkit.attention(q, k, v, backend="tiled", return_lse=True, **kw)
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    r2, rl2 = attnkit.attention(q2, k2, v2, backend="eager", return_lse=True, **kw)
    ref, ref_lse = r2.detach(), rl2.detach()
    tol = budget(torch.float32, D, S) * tol_scale
    live = torch.isfinite(ref_lse)
    assert_close(out, ref, tol, "out")
    assert torch.equal(torch.isfinite(lse), live), "rows that see no key: lse -inf exactly there"
    assert_close(lse[live], ref_lse[live], tol, "lse")
    go = torch.randn_like(out)
    gl = torch.randn_like(lse).masked_fill(~live, 0)
    loss = (out * go).sum() + ((lse.masked_fill(~live, 0) * gl).sum() if lse_grad else 0)
    got = torch.autograd.grad(loss, (q, k, v, *leaves))
    loss2 = (r2 * go.double()).sum() + ((rl2.masked_fill(~live, 0) * gl.double()).sum() if lse_grad else 0)
    want = torch.autograd.grad(loss2, (q2, k2, v2, *leaves))
    for name, a, b in zip(["dq", "dk", "dv"] + [f"leaf{i}" for i in range(len(leaves))], got, want, strict=True):
        assert torch.isfinite(a).all(), f"{name}: not finite"
        assert_close(a, b, 4 * tol * max(1.0, b.abs().max().item()), name)
    return out, got


SHAPES = [  # B, H, Hkv, L, S
    (1, 8, 2, 1, 1), (1, 8, 2, 1, 130), (2, 4, 4, 3, 70), (1, 6, 1, 16, 300), (1, 4, 2, 5, 2100),
]


@pytest.mark.parametrize("B,H,Hkv,L,S", SHAPES, ids=[f"B{b}H{h}/{hk}L{n}S{s}" for b, h, hk, n, s in SHAPES])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "padding"])
def test_few_rows_with_gradients_match_float64_on_the_decode_entry(calls, B, H, Hkv, L, S, mask):
    kw = {"none": {}, "causal": {"causal": True}, "window": {"mask": M.sliding_window(40)},
          "padding": {"mask": M.padding([S, max(1, S // 3)][:B])}}[mask]
    q, k, v = rand_qkv(B, H, Hkv, L, S, 32, requires_grad=True)
    assert attnkit.dispatch(q, k, v, backend="tiled", **kw).worker == "native"
    _check(q, k, v, **kw)
    assert calls["decode"] == 1 and calls["forward"] == 0, calls


def test_rows_that_see_no_key_and_split_k_chunks():
    """A batch row whose padding leaves no key (out 0, lse -inf, zero gradients) beside one over 2100 keys (the
    decode entry's chunks merged): both exact."""
    q, k, v = rand_qkv(2, 4, 2, 4, 2100, 16, requires_grad=True)
    out, (dq, dk, dv) = _check(q, k, v, mask=M.padding([0, 2100]) & M.causal())
    assert (out[0] == 0).all() and (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()


def test_score_mods_alibi_and_a_learnable_table(calls):
    H, L, S = 4, 6, 150
    q, k, v = rand_qkv(1, H, 2, L, S, 16, requires_grad=True, scale=2.0)
    _check(q, k, v, causal=True, score_mod=SM.softcap(1.7))
    _check(q, k, v, causal=True, score_mod=SM.alibi(torch.rand(H)))
    table = torch.randn(H, 9, requires_grad=True)  # a learnable table: the key-tile backward sums its gradient
    _check(q, k, v, mask=M.sliding_window(60), score_mod=SM.relative_bias(table), leaves=(table,))
    fixed = torch.randn(H, 9)  # a table without a gradient, a user's lambda: the few-rows backward runs the program
    _check(q, k, v, mask=M.sliding_window(60), score_mod=SM.relative_bias(fixed))
    _check(q, k, v, causal=True, score_mod=lambda s, b, h, qi, kv: s * torch.tanh(s) + 0.01 * (h * (kv - qi)))
    assert calls["decode"] == 5 and calls["forward"] == 0, calls


def test_score_mod_programs_at_every_instruction_set_and_in_bf16():
    """The few-rows backward's pass through a program (scaled scores kept, the program run, then its reverse mode)
    at each instruction set, and in bf16 against the fp32 kernel's gradients within bf16's budget."""
    q, k, v = rand_qkv(1, 8, 2, 2, 300, 24, requires_grad=True, scale=2.0)
    cap = SM.softcap(3.0)
    for isa in ("base", "avx2"):
        with instruction_set(isa):
            _check(q, k, v, mask=M.sliding_window(100), score_mod=cap)
    ql, kl, vl = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    got = torch.autograd.grad(attnkit.attention(ql, kl, vl, causal=True, score_mod=cap, backend="tiled").sum(),
                              (ql, kl, vl))
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (ql, kl, vl))
    want = torch.autograd.grad(attnkit.attention(qf, kf, vf, causal=True, score_mod=cap, backend="tiled").sum(),
                               (qf, kf, vf))
    for name, a, b in zip("qkv", got, want, strict=True):
        assert_close(a.float(), b, 4 * torch.finfo(torch.bfloat16).eps * max(1.0, b.abs().max().item()), f"d{name}")


def test_huge_negative_rows_and_nan_as_the_forward():
    """Rows whose every score is finfo.min (a score_mod that writes it) keep the exact-rows fix of the backward;
    a NaN in a key a row sees gives NaN in that row only, as the forward's tiles do."""
    q, k, v = rand_qkv(1, 4, 2, 4, 90, 16, requires_grad=True)
    fmin = torch.finfo(torch.float32).min

    def floor_row(s, b, h, qi, kv):
        return torch.where(qi == 2, torch.full_like(s, fmin), s)

    _check(q, k, v, causal=True, score_mod=floor_row)
    kn = k.detach().clone()
    kn[0, 1, 80] = float("nan")
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, kn, v))
    out = attnkit.attention(qq, kk, vv, mask=M.sliding_window(5), backend="tiled")
    ref = attnkit.attention(qq.detach(), kk.detach(), vv.detach(), mask=M.sliding_window(5), backend="tiled")
    assert torch.equal(out.isnan(), ref.isnan()), "NaN where the no-grad forward has it"
    out.sum().backward()
    assert not qq.grad[0, :2].isnan().any(), "heads of the other kv head stay finite"


def test_strided_views_and_low_precision(kernel_takes_bf16):
    """K / V as views into a bigger cache (read in place) and bf16 / fp16: the output in q's dtype is the fp32 row
    rounded once, the gradients within the low-precision budget of float64."""
    cache_k, cache_v = torch.randn(1, 2, 400, 32), torch.randn(1, 2, 400, 32)
    q = torch.randn(1, 8, 2, 32, requires_grad=True)
    k = cache_k[:, :, :333].requires_grad_()
    v = cache_v[:, :, :333].requires_grad_()
    assert not k.is_contiguous()
    _check(q, k, v, causal=True)
    for dt in (torch.bfloat16, torch.float16):
        ql, kl, vl = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        out = attnkit.attention(ql, kl, vl, causal=True, backend="tiled")
        assert out.dtype is dt
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (ql, kl, vl))
        out32 = attnkit.attention(q32, k32, v32, causal=True, backend="tiled")
        assert torch.equal(out, out32.to(dt)), f"{dt}: the fp32 row rounded once"
        go = torch.randn_like(out32)
        got = torch.autograd.grad(out, (ql, kl, vl), go.to(dt))
        want = torch.autograd.grad(out32, (q32, k32, v32), go.to(dt).float())
        eps = torch.finfo(dt).eps
        for name, a, b in zip("qkv", got, want, strict=True):
            assert a.dtype is dt
            assert_close(a.float(), b, 4 * eps * max(1.0, b.abs().max().item()), f"{dt} d{name}")


def test_beyond_sixteen_rows_and_partial_blocks_run_the_forward(calls):
    """L = 17 (one block of 17 rows) and L = 70 (a full block, then one of 6): the forward's query blocks, each
    computing only the columns of its rows."""
    for L in (17, 70):
        q, k, v = rand_qkv(1, 4, 2, L, 150, 16, requires_grad=True)
        _check(q, k, v, causal=True)
        _check(q, k, v, mask=M.sliding_window(20), score_mod=SM.softcap(2.0))
    assert calls["decode"] == 0 and calls["forward"] == 4, calls


def test_tile_maps_stay_on_the_forward(calls):
    """A mask whose rows are not one stretch of keys (its tile map and bits): the forward, at L = 4 too."""
    q, k, v = rand_qkv(1, 4, 2, 4, 130, 16, requires_grad=True)
    _check(q, k, v, mask=lambda b, h, qi, kv: ((qi + kv) % 3) != 0)
    assert calls["decode"] == 0 and calls["forward"] == 1, calls


def test_same_bits_on_one_and_two_threads():
    q, k, v = rand_qkv(1, 8, 2, 3, 2100, 32, requires_grad=True)
    res = []
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = attnkit.attention(q, k, v, causal=True, backend="tiled")
            res.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*res, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa", ["base", "avx2", "avx512"])
def test_every_instruction_set(isa):
    with instruction_set(isa):
        for dt in (torch.float32, torch.bfloat16):
            q, k, v = rand_qkv(1, 4, 2, 3, 200, 24, 40, requires_grad=True)
            if dt is torch.float32:
                _check(q, k, v, causal=True)
            else:  # bf16 grads against the fp32 kernel's, within bf16's budget
                ql, kl, vl = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
                got = torch.autograd.grad(attnkit.attention(ql, kl, vl, causal=True, backend="tiled").sum(),
                                          (ql, kl, vl))
                qf, kf, vf = (t.detach().float().requires_grad_() for t in (ql, kl, vl))
                want = torch.autograd.grad(attnkit.attention(qf, kf, vf, causal=True, backend="tiled").sum(),
                                           (qf, kf, vf))
                for name, a, b in zip("qkv", got, want, strict=True):
                    assert_close(a.float(), b, 4 * torch.finfo(dt).eps * max(1.0, b.abs().max().item()),
                                 f"{isa} bf16 d{name}")


@pytest.mark.parametrize("D,Dv", [(5, 7), (67, 64), (64, 128)])
def test_head_dims_and_an_expanded_output_gradient(D, Dv):
    """D, Dv not multiples of a vector (K rows padded for dQ's product), and out.sum().backward(): dO expanded
    with stride 0 (read in place, never copied whole)."""
    q, k, v = rand_qkv(2, 6, 3, 2, 150, D, Dv, requires_grad=True)
    _check(q, k, v, mask=M.sliding_window(50))
    out = attnkit.attention(q, k, v, causal=True, backend="tiled")
    got = torch.autograd.grad(out.sum(), (q, k, v))
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attnkit.attention(q2, k2, v2, causal=True, backend="eager").sum(), (q2, k2, v2))
    tol = budget(torch.float32, D, 150)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert_close(a, b, 4 * tol * max(1.0, b.abs().max().item()), f"d{name}")


def test_more_rows_than_a_block_per_kv_head():
    """g * L = 8 * 16 = 128 rows per kv head (more than one block of 64) and g * L = 64 exactly: both exact."""
    for H, Hkv, L in [(8, 1, 16), (4, 1, 16)]:
        q, k, v = rand_qkv(1, H, Hkv, L, 140, 16, requires_grad=True)
        _check(q, k, v, causal=True)


@pytest.mark.parametrize("entry", ["decode", "forward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prepared_backward_and_a_rounded_copy_beside_give_the_one_shot_calls_bits(entry, dtype):
    """``backward_step`` (the backward's record prepared once per signature) gives the bits of ``backward`` on calls
    of other strides, scales and values than the prepared one — dO expanded (``out.sum()``'s) or strided — and a
    forward step's ``beside`` output (bf16: out rounded by the kernel beside its fp32 out) the bits of
    ``out.to(bf16)``. A call of another shape or dtype is refused, naming the prepared one."""
    B, H, Hkv, L, S, D, Dv = 2, 4, 2, 3, 200, 16, 24
    g = torch.Generator().manual_seed(4)

    def qkv():
        return (torch.randn(B, H, L, D, generator=g).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(dtype),
                torch.randn(B, Hkv, S, Dv, generator=g).to(dtype))

    q, k, v = qkv()
    lo = torch.zeros(1, L, dtype=torch.int32)
    hi = torch.arange(S - L + 1, S + 1, dtype=torch.int32)[None]  # bottom-right causal
    half = dtype is not torch.float32
    if entry == "decode":
        fwd = _native.decode_step(q, k, v, lo, hi, with_lse=True, beside=half)
    else:
        fwd = _native.forward_step(q, k, v, lo, hi, with_lse=True, beside=half)
    bwd = _native.backward_step(q, k, v, lo, hi, rounded=True)
    for scale, strided in ((D ** -0.5, False), (0.3, True)):
        q, k, v = qkv()
        if strided:
            k = k.transpose(1, 2).contiguous().transpose(1, 2)
        got = fwd(q, k, v, scale)
        out, lse = got[:2]
        one_out, one_lse, _ = _native.forward(q, k, v, lo, hi, scale)
        # (bf16 on AMX tiles: the forward entry rounds P to bf16, at most 2^-9 max|v| in an output; the decode's
        # P . V stays fp32)
        tiles = 2.0 ** -9 * v.double().abs().max().item() if half and _native.bf16_dot() else 0.0
        assert_close(out, one_out, budget(torch.float32, D, S) + tiles, entry)
        assert_close(lse, one_lse, budget(torch.float32, D, S), entry)
        if half:
            assert torch.equal(got[2], out.to(dtype))
        for dout in (torch.ones(B, H, L, Dv, dtype=dtype),
                     torch.ones((), dtype=dtype).expand(B, H, L, Dv),
                     torch.randn(B, H, L, 2 * Dv, generator=g).to(dtype)[..., ::2]):
            want = _native.backward(q, k, v, lo, hi, scale, out, lse, dout, rounded=True)[:3]
            have = bwd(q, k, v, out, lse, dout, scale)
            assert all(torch.equal(a, b) for a, b in zip(have, want, strict=True)), (entry, scale, dout.stride())
            assert all(x.dtype == dtype for x in have)
    with pytest.raises(ValueError, match="backward prepared for q"):
        bwd(q[:, :, :2], k, v, out, lse, torch.ones(B, H, L, Dv, dtype=dtype), 0.3)
    with pytest.raises(TypeError, match="backward prepared for"):
        bwd(q, k, v, out, lse, torch.ones(B, H, L, Dv, dtype=torch.float16), 0.3)
    if half:
        with pytest.raises(ValueError, match="beside"):
            _native.decode_step(q, k, v, lo, hi, with_lse=True, beside=True, rounded=True)
    else:
        with pytest.raises(ValueError, match="beside"):
            _native.forward_step(q, k, v, lo, hi, with_lse=True, beside=True)
