"""Gradients on rows whose scores are all a huge finite negative (issue 18, item 1).

transformers pads with ``finfo.min``, the ``masked_fill(-1e9)`` idiom does the same, and
transformers' FlexAttention score_mod adds such a mask inside the mod. On such a row the
forward is the mean of V, but a backward that rebuilds the weights as ``exp(s - lse)`` gets 1
instead of 1/S: ``lse = m_i + log l_i`` rounds to ``m_i`` (``finfo.min + log 8 == finfo.min``).
torch's CPU flash backward (tiled's fused worker, SDPA's autograd) has that flaw inside.

What "the right answer" is. An fp32 call computes the scores ``fl32(q·k·scale + bias)``; on a
``finfo.min`` row (and on a -1e9 row, whose fp32 spacing is 64) the q·k term is below half an
ulp, so every score of the row is the *same* number and the exact softmax of those scores is
1/S: the forward's mean of V. Float64 autograd of the *unrounded* scores is another function
(with -1e9 it keeps q·k, so its weights are not 1/S) that no fp32 computation can be held to.
So the golden here is float64 autograd of the scores rounded to the call's dtype, with the
rounding passed through as the identity (straight-through: d fl(s)/ds = 1, which is what the
fp32 arithmetic's own derivative is). For fp64 calls the rounding is to fp64: the golden is
plain float64 autograd (up to one rounding of each score).

Error budget (fp32/fp64): the gradients are sums of S terms p·(dp − delta) with dot products
of length D; conftest's budget ``16 eps (√D + √S)`` for outputs, times 32 for the backward's
extra products and the magnitude of the largest gradient (as tests/backends/test_fuzz.py does). The
flaw gives errors of order 1 (fp32 and fp64 alike: it is log S that is lost, not a few ulps).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import EPS, fused

import attnkit
from attnkit.backends import _softmax, _tiles

B, H, HKV, L, S, D = 2, 4, 2, 13, 11, 8  # GQA (g = 2), L != S


def budget(dtype, ref):
    return 32 * 16 * EPS[dtype] * (math.sqrt(D) + math.sqrt(S)) * max(1.0, ref.abs().max().item())


def rows_bias(dtype, kind):
    """A (B, 1, L, S) additive mask: random small values, with these rows overwritten:

    finfo.min   every key at finfo.min (transformers' padding)
    -1e9        every key at -1e9 (masked_fill(-1e9))
    mixed       row 0 finfo.min, row 1 -1e9, row 2 -inf (dead: out 0, gradients 0),
                row 3 half -inf / half finfo.min, row 4 finfo.min on half its keys only,
                and batch row 1 padded at its last three rows (left-padding style)
    """
    g = torch.Generator().manual_seed(1)
    bias = (torch.randn(B, 1, L, S, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    lo = torch.finfo(dtype).min
    if kind == "finfo.min":
        bias[:, :, :3] = lo
    elif kind == "-1e9":
        bias[:, :, 2:5] = -1e9
    else:
        bias[0, :, 0] = lo
        bias[0, :, 1] = -1e9
        bias[0, :, 2] = float("-inf")
        bias[0, :, 3, ::2] = float("-inf")
        bias[0, :, 3, 1::2] = lo
        bias[0, :, 4, : S // 2] = lo
        bias[1, :, -3:] = lo
    return bias


def golden(q, k, v, dtype, *, bias=None, mod=None, dout, dlse=None, wrt_bias=False):
    """Float64 autograd on the scores rounded to ``dtype`` (see the module docstring)."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    bd = None if bias is None else bias.detach().double().requires_grad_(wrt_bias)
    g = q.shape[1] // k.shape[1]
    s = (qd @ kd.repeat_interleave(g, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mod is not None:
        s = mod(s, *torch.meshgrid(*(torch.arange(n) for n in s.shape), indexing="ij"))
    if bd is not None:
        s = s + bd
    rounding = s.detach().to(dtype).double() - s.detach()
    s = s + torch.where(torch.isfinite(s), rounding, 0.0)  # round to the call's dtype, straight through
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a dead row (all -inf): out 0
    p = torch.exp(s - m)
    l_i = p.sum(-1, keepdim=True)
    out = (p / l_i.clamp_min(1e-300)) @ vd.repeat_interleave(g, 1)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        live = l_i > 0  # log(0)'s gradient is NaN even where masked away
        lse = torch.where(live, m + torch.log(torch.where(live, l_i, torch.ones_like(l_i))), 0.0).squeeze(-1)
        loss = loss + (lse * dlse.double()).sum()
    wrt = [qd, kd, vd] + ([bd] if wrt_bias else [])
    return out, torch.autograd.grad(loss, wrt)


def inputs(dtype, bias_grad=False, kind="mixed"):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
               for h, n in ((H, L), (HKV, S), (HKV, S)))
    bias = rows_bias(dtype, kind).requires_grad_(bias_grad)
    dout = torch.randn(B, H, L, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, bias, dout


# (backend asked for, tiled.FUSED, the (backend, worker) attnkit.dispatch must report)
RUNS = {
    "eager": ("eager", True, ("eager", "math")),
    "sdpa": ("sdpa", True, ("sdpa", "tiled")),  # SDPA's own autograd has the flaw: handed to tiled
    "tiled-fused": ("tiled", True, ("tiled", "fused")),
    "tiled-plain": ("tiled", False, ("tiled", "plain")),
    "auto": ("auto", True, ("tiled", "fused")),
}



def check(got, want, dtype, what):
    assert len(got) == len(want), what
    for name, a, b in zip(("dq", "dk", "dv", "dbias")[:len(got)], got, want, strict=True):  # dbias: with a bias
        assert a is not None, f"{what}: {name} is None"
        assert not torch.isnan(a).any(), f"{what}: NaN in {name}"
        err = (a.double() - b).abs().max().item()
        tol = budget(dtype, b)
        assert err <= tol, f"{what}: {name} off by {err:.3g} > {tol:.3g} (float64 golden on rounded scores)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["finfo.min", "-1e9", "mixed"])
@pytest.mark.parametrize("run", list(RUNS))
def test_float_mask_huge_negative_rows_gradients(run, kind, dtype):
    backend, on, want = RUNS[run]
    q, k, v, bias, dout = inputs(dtype, kind=kind)
    with fused(on):
        out = attnkit.attention(q, k, v, mask=bias, backend=backend)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        d = attnkit.dispatch(q, k, v, mask=bias, backend=backend)
    ref_out, ref = golden(q, k, v, dtype, bias=bias, dout=dout)
    what = f"{run} {kind} {dtype}"
    assert (out.double() - ref_out).abs().max() <= budget(dtype, ref_out), f"{what}: forward"
    check(grads, ref, dtype, what)
    assert (d.backend, d.worker) == want, f"{what}: ran {d.backend}/{d.worker}, expected {want}"


def test_the_issue_reproducer():
    """The 8×8 example of issue 18 (dv was off by 2.6 on tiled)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 8, 4, requires_grad=True) for _ in range(3))
    bias = torch.zeros(8, 8)
    bias[:3] = torch.finfo(torch.float32).min
    for backend in ("tiled", "sdpa", "auto", "eager"):
        out = attnkit.attention(q, k, v, mask=bias, backend=backend)
        dout = torch.ones_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        _, ref = golden(q, k, v, torch.float32, bias=bias, dout=dout)
        check(grads, ref, torch.float32, f"reproducer {backend}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("run", ["eager", "sdpa", "tiled-fused", "auto"])
def test_gradients_into_a_float_mask_requiring_grad(run, dtype):
    """d bias on finfo.min / -1e9 / -inf rows (the plain worker takes these; sdpa hands them to it)."""
    backend, on, _ = RUNS[run]
    q, k, v, bias, dout = inputs(dtype, bias_grad=True)
    with fused(on):
        out = attnkit.attention(q, k, v, mask=bias, backend=backend)
        grads = torch.autograd.grad(out, (q, k, v, bias), dout)
        d = attnkit.dispatch(q, k, v, mask=bias, backend=backend)
    _, ref = golden(q, k, v, dtype, bias=bias, dout=dout, wrt_bias=True)
    check(grads, ref, dtype, f"{run} d bias {dtype}")
    assert d.worker == ("math" if run == "eager" else "tiled" if run == "sdpa" else "plain"), d


def transformers_mod(mask4, cap=None):
    """transformers' FlexAttention score_mod: an optional softcap, then ``+ mask[b, 0, q, kv]``
    where the mask is the model's float mask (finfo.min on padding and the future)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        return score + mask4[b, 0, q_idx, kv_idx]
    return score_mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cap", [None, 20.0])
@pytest.mark.parametrize("backend", ["eager", "tiled", "auto"])
def test_score_mod_writing_finfo_min(backend, cap, dtype):
    q, k, v, bias, dout = inputs(dtype)
    mask4 = bias.detach()
    mod = transformers_mod(mask4, cap)
    out = attnkit.attention(q, k, v, score_mod=mod, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    d = attnkit.dispatch(q, k, v, score_mod=mod, backend=backend)

    def ref_mod(s, b, h, i, j):
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        return s + mask4.double()[b, 0, i, j]

    _, ref = golden(q, k, v, dtype, mod=ref_mod, dout=dout)
    check(grads, ref, dtype, f"score_mod {backend} cap={cap} {dtype}")
    # fp32: the score_mod runs as a program on the compiled kernel (rows of finfo.min exact there too)
    ran = {"eager": ("eager", "math"), "tiled": ("tiled", "native" if dtype == torch.float32 else "plain")}
    assert (d.backend, d.worker) == ran["eager" if backend == "eager" else "tiled"], d


@pytest.mark.parametrize("on", [True, False])
def test_lse_gradient_on_huge_negative_rows(on):
    """A loss on lse too: the fused worker hands lse gradients to the plain loop; both exact."""
    dtype = torch.float32
    q, k, v, bias, dout = inputs(dtype)
    dlse = torch.randn(B, H, L, dtype=torch.float64).to(dtype)
    with fused(on):
        out, lse = attnkit.attention(q, k, v, mask=bias, backend="tiled", return_lse=True)
    loss = (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    _, ref = golden(q, k, v, dtype, bias=bias, dout=dout, dlse=dlse)
    check(grads, ref, dtype, f"lse gradient fused={on}")


@pytest.mark.parametrize("backend", ["tiled", "eager"])
def test_returned_weights_on_huge_negative_rows(backend):
    """``return_weights`` rebuilds weights from lse too: a finfo.min row's weights are 1/S."""
    q, k, v, bias, _ = inputs(torch.float32, kind="finfo.min")
    with torch.no_grad():
        _, w = attnkit.attention(q, k, v, mask=bias, backend=backend, return_weights=True)
    torch.testing.assert_close(w[:, :, :3], torch.full_like(w[:, :, :3], 1 / S))
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))


def test_ordinary_rows_never_take_the_exact_row_path(monkeypatch):
    """The fix costs O(L) when no row needs it: the dense row recomputation is not entered."""
    def boom(*a, **kw):
        raise AssertionError("exact_rows_backward ran on ordinary rows")

    monkeypatch.setattr(_tiles, "exact_rows_backward", boom)
    q, k, v, _, dout = inputs(torch.float32)
    bias = torch.randn(1, 1, L, S) * 3
    bias[..., 0] = torch.finfo(torch.float32).min  # masked keys on live rows are fine
    for on in (True, False):
        with fused(on):
            out = attnkit.attention(q, k, v, mask=bias, backend="tiled")
            torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_quick_check_agrees_with_the_rows(dtype):
    """``any_inexact`` (NumPy on a CPU tensor's memory, torch's ops otherwise) says what ``inexact_rows().any()``
    says: dead rows (-inf), NaN and ordinary rows are exact, a finite |lse| past LSE_EXACT_MAX is not."""
    big = _softmax.LSE_EXACT_MAX * 4
    cases = [[1.0, -3.0], [1.0, float("-inf")], [float("nan"), 2.0], [float("inf")], [], [1.0, -big],
             [big, float("-inf")], [float("nan"), big], [_softmax.LSE_EXACT_MAX, -_softmax.LSE_EXACT_MAX]]
    for c in cases:
        x = torch.tensor(c, dtype=dtype).reshape(1, -1, 1)
        want = bool(_softmax.inexact_rows(x).any())
        assert _softmax.any_inexact(x) is want, (c, dtype)
        assert _softmax.any_inexact(x.t() if x.dim() == 2 else x.transpose(0, 1)) is want, ("a view", c, dtype)
