"""The fast path of ``attention()`` (``attnkit._fast``) against the full path and the float64 golden.

Its contract: it answers only calls for which ``auto`` decides ``sdpa`` (fused), with the same
kernel arguments; everything else, every error included, goes through the full path.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
import torch
from conftest import assert_close, budget, full_path, golden, require_kernel

import attnkit
from attnkit import _fast, masks, positional, score_mods
from attnkit.backends import _native

SPY = []


@pytest.fixture
def spy(monkeypatch):
    """Record what the fast path answered (None = handed over to the full path)."""
    real = _fast.attention
    SPY.clear()

    def wrapped(*a):
        out = real(*a)
        SPY.append(out is not None)
        return out

    monkeypatch.setattr(_fast, "attention", wrapped)
    return SPY


@pytest.fixture
def full_path_only(monkeypatch):
    monkeypatch.setattr(_fast, "attention", lambda *a: None)


_full = full_path  # the same call through the full path (make_request -> decide -> backend)


def _layout(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "contiguous":
        return t
    if how == "step2":  # last-dim stride 2
        return torch.stack([t, torch.full_like(t, 99.0)], dim=-1).flatten(-2)[..., ::2]
    if how == "bshd":  # (B, S, H, D) memory viewed as (B, H, S, D), as models hand it over
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    raise AssertionError(how)


CASES = [  # (B, H, Hkv, L, S, D, kwargs) inside the contract
    (1, 8, 2, 1, 128, 64, dict(causal=True)),
    (1, 8, 2, 1, 37, 64, dict()),
    (2, 4, 4, 64, 64, 16, dict(causal=True)),
    (1, 4, 2, 33, 33, 24, dict(causal=True)),
    (1, 4, 1, 4, 50, 16, dict(causal=True)),  # bottom-right decode chunk, L < S
    (2, 2, 2, 16, 17, 8, dict(causal=True)),
    (1, 2, 2, 5, 3, 8, dict(mask=masks.causal("top_left"))),  # L > S, top-left: SDPA's is_causal
    (1, 4, 2, 3, 40, 16, dict(mask=masks.sliding_window(7))),
    (1, 4, 2, 16, 16, 16, dict(mask=masks.sliding_window(5, "top_left"))),
    (1, 4, 2, 1, 40, 16, dict(mask=masks.sliding_window(400))),  # as wide as S: no mask at L = 1
    (3, 4, 2, 2, 30, 16, dict(mask=masks.padding([30, 9, 1]))),
    (1, 4, 2, 3, 40, 16, dict(mask=masks.chunked(8))),
    (2, 4, 2, 2, 12, 16, dict(mask=masks.key_padding(torch.arange(12).expand(2, 12) % 5 != torch.tensor([[1], [3]])))),
    (2, 4, 2, 1, 12, 16, dict(mask=masks.causal() & masks.padding([12, 5]))),  # L = 1: the padding alone
    (2, 4, 2, 4, 12, 16, dict(mask=masks.sliding_window(6) & masks.padding([12, 10]))),
    (1, 2, 1, 1, 1, 4, dict(causal=True)),
    (2, 4, 2, 1, 30, 16, dict(mask="bias (1, 1, L, S)")),
    (2, 4, 2, 40, 30, 16, dict(mask="bias (B, H, L, S)")),
    (2, 4, 2, 5, 30, 16, dict(mask="bias (L, S)")),
    (2, 4, 2, 3, 30, 16, dict(mask="bool (B, 1, 1, S)")),
    (1, 4, 4, 16, 16, 16, dict(mask="bool (L, S)")),
    (2, 3, 3, 7, 7, 5, dict(scale=0.3)),
    (1, 2, 2, 6, 6, 8, dict(causal=True, scale=2)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}/{c[2]}L{c[3]}S{c[4]}D{c[5]}-{sorted(c[6])}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "step2", "bshd"])
def test_fast_path_matches_golden_and_full_path(case, dtype, layout, spy):
    B, H, Hkv, L, S, D, kw = case
    g = torch.Generator().manual_seed(L * 131 + S)
    if isinstance(kw.get("mask"), str):  # a user tensor mask of the named shape, in the call's dtype
        kind, shape = kw["mask"].split(" ", 1)
        dims = dict(B=B, H=H, L=L, S=S)
        shape = tuple(dims.get(x.strip(), 1) for x in shape.strip("()").split(","))
        m = torch.randn(shape, generator=g, dtype=torch.float64)
        kw = dict(kw, mask=(m.to(dtype) if kind == "bias" else (m > -0.8) | (torch.arange(S) == 0)))
    q, k, v = (torch.randn(B, h, n, D, generator=g, dtype=torch.float64)
               for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    q, k, v = (_layout(t.to(dtype), layout) for t in (q, k, v))
    out = attnkit.attention(q, k, v, **kw)
    assert spy == [True], "this call is inside the fast path's contract"
    d = attnkit.dispatch(q, k, v, **kw)
    # what auto decides for the same call: SDPA, or the compiled kernel's decode entry (a decode step, no gradient)
    assert (d.backend, d.worker) in (("sdpa", "fused"), ("tiled", "native")), d
    assert d.kernel is not None and hasattr(d.kernel, "replay"), d
    ref, _ = golden(q, k, v, **kw)
    full = _full(q, k, v, **kw)
    assert out.dtype == dtype and out.shape == ref.shape == full.shape
    if dtype == torch.bfloat16:
        tol = 4e-2  # bf16 inputs and output: a few output ulps at |out| <~ 2
        assert (full.double() - ref).abs().max().item() <= tol
    else:
        tol = budget(dtype, D, S)
    assert (out.double() - ref).abs().max().item() <= tol
    assert (out.double() - full.double()).abs().max().item() <= tol


def test_fast_path_gradients_equal_golden(spy):
    g = torch.Generator().manual_seed(3)
    for kw in (dict(causal=True), dict(mask=masks.sliding_window(5)), dict()):
        L, S = (3, 20) if "mask" in kw else (12, 12)
        q, k, v = (torch.randn(2, h, n, 16, generator=g, dtype=torch.float64).requires_grad_()
                   for h, n in ((4, L), (2, S), (2, S)))
        spy.clear()
        out = attnkit.attention(q, k, v, **kw)
        assert spy == [True]
        go = torch.randn(out.shape, generator=g, dtype=torch.float64)
        grads = torch.autograd.grad(out, (q, k, v), go)
        qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ref = attnkit.attention(qd, kd, vd, backend="eager", **kw)
        refs = torch.autograd.grad(ref, (qd, kd, vd), go)
        for a, b in zip(grads, refs, strict=True):
            assert (a - b).abs().max().item() <= 1e-12


_CAPS = [1.0, 0]  # a list: a mod reading it has no key (its values may change between calls unseen)

OUTSIDE = [  # calls the fast path must hand over (and what makes them so)
    ("numpy inputs", lambda q, k, v: ((q.numpy(), k.numpy(), v.numpy()), {})),
    ("3-D inputs", lambda q, k, v: ((q[0], k[0], v[0]), {})),
    ("return_lse", lambda q, k, v: ((q, k, v), dict(return_lse=True))),
    ("return_weights", lambda q, k, v: ((q, k, v), dict(return_weights=True))),
    ("bool tensor mask, L > 64", lambda q, k, v: ((q.repeat(1, 1, 9, 1), k, v),
                                                 dict(mask=torch.ones(72, 8, dtype=torch.bool)))),
    ("bias with causal", lambda q, k, v: ((q, k, v), dict(mask=torch.zeros(8, 8, dtype=torch.float64), causal=True))),
    ("a row masked fully", lambda q, k, v: ((q, k, v), dict(mask=torch.arange(8)[:, None] != 2))),
    ("score_mod reading a list", lambda q, k, v: ((q, k, v), dict(score_mod=lambda s, b, h, i, j: s * _CAPS[0]))),
    ("named backend", lambda q, k, v: ((q, k, v), dict(backend="sdpa"))),
    ("mask_mod reading a list", lambda q, k, v: ((q, k, v), dict(mask=lambda b, h, i, j: i >= j - _CAPS[1]))),
    ("window at L = S > 16", lambda q, k, v: ((q.repeat(1, 1, 3, 1), k.repeat(1, 1, 3, 1), v.repeat(1, 1, 3, 1)),
                                              dict(mask=masks.sliding_window(3)))),
    ("document mask", lambda q, k, v: ((q, k, v), dict(mask=masks.document([0] * 4 + [1] * 4)))),
    ("padding with an empty row", lambda q, k, v: ((q, k, v), dict(mask=masks.padding([0])))),
    ("bottom-right causal with L > S", lambda q, k, v: ((q, k[:, :, :5], v[:, :, :5]), dict(causal=True))),
    ("numpy float64 scale", lambda q, k, v: ((q, k, v), dict(scale=np.float64(0.5)))),
]


@pytest.mark.parametrize("name, make", OUTSIDE, ids=[o[0] for o in OUTSIDE])
def test_calls_outside_the_contract_take_the_full_path(name, make, spy):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    args, kw = make(q, k, v)
    out = attnkit.attention(*args, **kw)
    assert not any(spy), f"{name}: the fast path answered a call outside its contract"
    assert SPY == [] or SPY == [False]
    ref, _ = golden(*args, **{k_: v_ for k_, v_ in kw.items() if k_ not in ("return_lse", "return_weights", "backend")})
    got = out[0] if isinstance(out, tuple) else out
    assert np.abs(np.asarray(got, dtype=np.float64) - np.asarray(ref)).max() <= 1e-12


BAD = [  # (what, call) -- each must raise exactly what the full path raises
    ("k head dim", lambda q, k, v: attnkit.attention(q, k[..., :7], v)),
    ("Hkv not dividing H", lambda q, k, v: attnkit.attention(q.repeat(1, 3, 1, 1), k.repeat(1, 2, 1, 1),
                                                               v.repeat(1, 2, 1, 1))),
    ("batch", lambda q, k, v: attnkit.attention(q, k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1))),
    ("dtype", lambda q, k, v: attnkit.attention(q, k.float(), v)),
    ("scale nan", lambda q, k, v: attnkit.attention(q, k, v, scale=float("nan"))),
    ("scale bool", lambda q, k, v: attnkit.attention(q, k, v, scale=True)),
    ("bias dtype", lambda q, k, v: attnkit.attention(q, k, v, mask=torch.zeros(8, 8, dtype=torch.float32))),
    ("mask shape", lambda q, k, v: attnkit.attention(q, k, v, mask=torch.zeros(3, 8, dtype=torch.float64))),
    ("int mask", lambda q, k, v: attnkit.attention(q, k, v, mask=torch.ones(8, 8, dtype=torch.int64))),
    ("causal string", lambda q, k, v: attnkit.attention(q, k, v, causal="yes")),
    ("padding batch", lambda q, k, v: attnkit.attention(q[:, :, :1], k, v, mask=masks.padding([3, 4]))),
    ("padding too long", lambda q, k, v: attnkit.attention(q[:, :, :1], k, v, mask=masks.padding([9]))),
    ("backend name", lambda q, k, v: attnkit.attention(q, k, v, backend="fast")),
    ("dropout", lambda q, k, v: attnkit.attention(q, k, v, dropout_p=1.5)),
]


@pytest.mark.parametrize("what, call", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_get_the_full_paths_error(what, call, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    with pytest.raises((TypeError, ValueError)) as fast_err:
        call(q, k, v)
    monkeypatch.setattr(_fast, "attention", lambda *a: None)
    with pytest.raises(type(fast_err.value)) as full_err:
        call(q, k, v)
    assert str(fast_err.value) == str(full_err.value)
    assert any(w in str(fast_err.value) for w in ("expected", "must be", "must have")), str(fast_err.value)


@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_row_the_kernel_zeroes_is_recomputed_not_returned_as_zero(where, value, spy):
    """torch's CPU kernel writes an all-zero row where a causal row's scores hold inf; the
    documented result is NaN there (as the golden). The fast path hands such outputs over."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    dict(q=q, k=k)[where][0, 0, 0, 3] = value
    out = attnkit.attention(q, k, v, causal=True)
    ref, _ = golden(q, k, v, causal=True)
    assert torch.equal(out.isnan(), torch.as_tensor(ref).isnan())
    fin = ~out.isnan()
    assert (out[fin].double() - ref[fin]).abs().max().item() <= budget(torch.float32, 16, 64)


def test_debug_logging_still_logs_every_decision(caplog, spy):
    q = k = v = torch.randn(1, 2, 4, 8)
    with caplog.at_level(logging.DEBUG, logger="attnkit"):
        attnkit.attention(q, k, v, causal=True)
    assert spy == [False]
    assert any("attnkit.attention -> " in r.getMessage() for r in caplog.records)


def test_decode_tile_equals_the_mask_it_stands_for():
    """Mask.decode_tile (closed form) against materialize, over every size near the edges."""
    for mask, B in [(masks.causal(), 1), (masks.causal("top_left"), 1), (masks.sliding_window(1), 1),
                    (masks.sliding_window(3), 1), (masks.sliding_window(4, "top_left"), 1),
                    (masks.padding([5, 1, 3]), 3), (masks.chunked(3), 1), (masks.chunked(2, "top_left"), 1),
                    (masks.key_padding(torch.tensor([[0, 1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]]).bool()), 2),
                    (masks.causal() & masks.padding([4, 6]), 2),
                    (masks.sliding_window(2) & masks.key_padding(torch.tensor([[1, 0, 1, 1, 0, 1, 1, 1]]).bool()), 1)]:
        for L, S in itertools.product(range(1, 7), range(1, 9)):
            tile = mask.decode_tile(B, L, S, "cpu")
            try:
                dense = mask.materialize(B, 1, L, S)
            except ValueError:
                assert tile is None, (mask, L, S)
                continue
            if tile is None:  # offered away when a row would see no key (windows, chunks: whenever L > S;
                # key_padding: when S is not its own length, an invalid size)
                assert (not dense.any(-1).all() or (isinstance(mask, (masks.SlidingWindow, masks.Chunked)) and L > S)
                        or (isinstance(mask, masks.And) and L > S)), (mask, L, S)
                continue
            j0, j1, allowed = tile
            assert dense.any(-1).all(), (mask, L, S)
            assert not dense[..., :j0].any() and not dense[..., j1:].any(), (mask, L, S)
            assert torch.equal(allowed.expand(B, 1, L, j1 - j0), dense[..., j0:j1]), (mask, L, S)


# --- the replay: a decision remembered per call signature (attnkit._fast) -----------------------------------


def test_replay_reads_the_calls_own_tensor_mask_not_the_first_ones(spy):
    """A replayed decision keeps only what the signature fixes: the mask's values are each call's own (an
    in-place edit, or a new tensor of the same shape, gives that call's answer)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64) for _ in range(2))
    m = torch.rand(4, 8, generator=g) > 0.3
    m[:, 0] = True  # no row masked fully
    for step in range(4):
        spy.clear()
        out = attnkit.attention(q, k, v, mask=m)
        ref, _ = golden(q, k, v, mask=m)
        assert (out - torch.as_tensor(ref)).abs().max().item() <= 1e-12, step
        if step:
            assert spy == [True]  # replayed
        m[:, 1 + step] = ~m[:, 1 + step]  # edited in place: the next call must see it


def test_replay_never_serves_a_decision_that_read_the_masks_values(spy):
    """At L = S = 128 the table reads a bool mask's tiles (skip them on tiled, or SDPA when all are partial):
    that decision is about those values, so it is never replayed for another mask of the same shape."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 128, 8, generator=g, dtype=torch.float64) for _ in range(3))
    banded = (torch.arange(128)[:, None] - torch.arange(128)[None, :]).abs() < 8
    rand = torch.rand(128, 128, generator=g) > 0.5
    rand[:, 0] = True
    for m in (banded, rand, banded, rand):
        spy.clear()
        out = attnkit.attention(q, k, v, mask=m)
        ref, _ = golden(q, k, v, mask=m)
        assert (out - torch.as_tensor(ref)).abs().max().item() <= 1e-12
        assert spy == [False]


def test_replay_follows_what_the_signature_holds(spy, monkeypatch):
    """Another built-in mask, another scale, the compiled kernel switched off, another thread count: each a
    decision of its own, each answer equal to the golden one; a non-finite scale after a replayed call still
    raises the full path's error."""
    from attnkit.backends import tiled

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2].repeat(1, 1, 7, 1), v[:, :2].repeat(1, 1, 7, 1)  # GQA 4/2, S = 21
    for kw in (dict(mask=masks.sliding_window(4)), dict(mask=masks.sliding_window(9)), dict(causal=True),
               dict(mask=masks.sliding_window(4), scale=0.3), dict(mask=masks.sliding_window(4), scale=2)):
        for _ in range(2):
            out = attnkit.attention(q, k, v, **kw)
            ref, _ = golden(q, k, v, **kw)
            assert (out - torch.as_tensor(ref)).abs().max().item() <= 1e-12, kw
    with pytest.raises(ValueError, match="scale"):
        attnkit.attention(q, k, v, mask=masks.sliding_window(4), scale=float("inf"))
    monkeypatch.setattr(tiled, "NATIVE", False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out = attnkit.attention(q, k, v, causal=True)
        ref, _ = golden(q, k, v, causal=True)
        assert (out - torch.as_tensor(ref)).abs().max().item() <= 1e-12
    finally:
        torch.set_num_threads(threads)


def test_one_tile_bool_mask_goes_to_the_kernel_or_sdpa_and_is_replayed(spy):
    """A bool mask of one 64 x 64 tile without gradients: fp32 on the compiled kernel (its C pass reads the tile's
    bits per call), float64 (the kernel computes in fp32) and fp32 with gradients on SDPA as it is; the next call
    with the same signature replays either, exact against the golden."""
    g = torch.Generator().manual_seed(8)
    m = torch.rand(64, 64, generator=g) > 0.5
    m[:, 0] = True
    for dt, grad in ((torch.float64, False), (torch.float32, False), (torch.float32, True)):
        q, k, v = (torch.randn(1, 2, 64, 16, generator=g, dtype=dt).requires_grad_(grad) for _ in range(3))
        d = attnkit.dispatch(q, k, v, mask=m)
        kernel = dt is torch.float32 and not grad and _native.available()
        assert (d.backend, d.worker) == (("tiled", "native") if kernel else ("sdpa", "fused")), (dt, grad)
        assert "one 64 x 64 tile" in d.reason
        for _ in range(2):
            spy.clear()
            out = attnkit.attention(q, k, v, mask=m)
        assert spy == [True]
        ref, _ = golden(q, k, v, mask=m)
        tol = 1e-12 if dt is torch.float64 else budget(dt, 16, 64)
        assert (out.detach().double() - torch.as_tensor(ref)).abs().max().item() <= tol


def test_replayed_compiled_kernel_call_forward_and_backward_equal_golden(spy):
    """A call auto sends to the compiled kernel (causal at L >= 256, a window) is replayed too: the request is
    rebuilt around each call's tensors (its mask's row intervals kept), gradients included."""
    require_kernel()
    g = torch.Generator().manual_seed(9)
    for kw in (dict(causal=True), dict(mask=masks.sliding_window(40)), dict(mask=masks.padding([300, 170]))):
        for step in range(3):
            q, k, v = (torch.randn(2, 2, 300, 16, generator=g, dtype=torch.float32).requires_grad_() for _ in range(3))
            spy.clear()
            out = attnkit.attention(q, k, v, **kw)
            if step:
                assert spy == [True], kw
            d = attnkit.dispatch(q, k, v, **kw)
            assert (d.backend, d.worker) == ("tiled", "native"), d
            go = torch.randn(out.shape, generator=g)
            grads = torch.autograd.grad(out, (q, k, v), go)
            qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
            ref = attnkit.attention(qd, kd, vd, backend="eager", **kw)
            refs = torch.autograd.grad(ref, (qd, kd, vd), go.double())
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 300)
            for a, b in zip(grads, refs, strict=True):
                assert (a.double() - b).abs().max().item() <= 4 * budget(torch.float32, 16, 300)


def test_masks_keyed_by_identity_are_few_in_the_replay_cache():
    """A document mask (its ids a tensor) is keyed by identity: a model building a new one every step keeps at
    most a few in the cache, and each call's answer is its own mask's."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 2, 1, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = k.repeat(1, 1, 20, 1), v.repeat(1, 1, 20, 1)
    for step in range(20):
        ids = (torch.arange(20) >= step).long()
        m = masks.document(ids)
        out = attnkit.attention(q, k, v, mask=m)
        ref, _ = golden(q, k, v, mask=m)
        assert (out - torch.as_tensor(ref)).abs().max().item() <= 1e-12, step
    assert len(_fast._BY_IDENTITY) <= _fast._BY_IDENTITY_MAX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "step2", "bshd"])
def test_replayed_compiled_kernel_call_without_gradients_is_the_full_paths(dtype, layout, spy, kernel_takes_bf16):
    """Without gradients a replayed compiled-kernel call is one prepared record (``_native.forward_step``): each
    call writes its own strides, pointers and scale into it. Bit for bit the full path's answer, whatever the
    layout of this call (the signature does not hold strides) and the scale it passes; within budget of golden."""
    require_kernel()
    g = torch.Generator().manual_seed(11)
    kws = (dict(causal=True), dict(mask=masks.sliding_window(40)), dict(mask=masks.padding([300, 170])),
           dict(mask=masks.key_padding(torch.arange(300).expand(2, 300) % 7 != 3)))  # the last: a tile map
    with torch.no_grad():
        for kw in kws:
            for step, scale in enumerate((None, 0.3, None, 0.7)):
                q, k, v = (_layout(torch.randn(2, 4, 300, 16, generator=g).to(dtype), layout if step % 2 else
                                   "contiguous") for _ in range(3))
                k, v = k[:, :2], v[:, :2]  # GQA 4 / 2
                spy.clear()
                out = attnkit.attention(q, k, v, scale=scale, **kw)
                if step:
                    assert spy == [True], kw
                d = attnkit.dispatch(q, k, v, scale=scale, **kw)
                assert (d.backend, d.worker) == ("tiled", "native"), d
                full = _full(q, k, v, scale=scale, **kw)
                assert out.dtype == dtype and torch.equal(out, full), (kw, step)
                ref, _ = golden(q, k, v, scale=scale, **kw)
                tol = 4e-2 if dtype == torch.bfloat16 else budget(dtype, 16, 300)
                assert (out.double() - ref).abs().max().item() <= tol, (kw, step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_zero_row_check_reads_the_first_column_at_any_strides(dtype):
    """``may_hide_nan`` (read in C where the kernel is loaded): true iff some row's first element is +0, -0 or NaN
    (a row of zeros where torch's kernel hid a NaN; a NaN row an inf in a hidden key may have made); inf and tiny
    numbers are neither; any strides (SDPA hands back (B, L, H, D) memory viewed as (B, H, L, D))."""
    from attnkit.backends import _native, sdpa

    g = torch.Generator().manual_seed(12)
    base = torch.randn(3, 70, 5, 9, generator=g).to(dtype) + 10  # no zeros
    for out in (base, base.transpose(1, 2), base[:, ::3, 1:], base.transpose(1, 2)[..., 2:]):
        assert sdpa.may_hide_nan(out) is False
        for value in (0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-30, torch.finfo(dtype).tiny):
            w = out.clone()  # (1e-30 is 0 in fp16)
            w[2, -1, 1, 0] = value
            x = w[2, -1, 1, 0].item()
            expect = x == 0.0 or x != x
            assert sdpa.may_hide_nan(w) is expect, (value, w.stride())
            assert sdpa._reduce_check(w) is expect, (value, w.stride())  # (the check without the kernel)
            assert sdpa.may_hide_nan(w, whole=True) is expect, (value, w.stride())
    # under a mask, a NaN anywhere in a row (a NaN value at a key the mask hides, read at weight 0): the whole
    # output is read, at any strides of the last dim too
    views = (lambda t: t, lambda t: t.transpose(1, 2), lambda t: t[..., ::2], lambda t: t.transpose(1, 3)[:, :4])
    for view in views:
        for col in (1, view(base).shape[-1] // 2, -1):
            for value, flagged in ((float("nan"), True), (float("inf"), False), (0.0, False)):
                w = view(base.clone())  # (a view: its strides as they are, the last dim's too)
                w[1, -1, 2, col] = value
                assert sdpa.may_hide_nan(w, whole=True) is flagged, (value, col, w.stride())
                assert sdpa._reduce_check(w, True) is flagged, (value, col, w.stride())
                assert sdpa.may_hide_nan(w) is False, (value, col, w.stride())  # the first column alone
    if _native.available():
        assert _native.suspect_rows_fn() is not None


def test_a_mask_without_a_key_is_never_replayed_as_no_mask(spy):
    """A combined mask whose part has no cache key (a mask_mod reading an object's attribute, which the key cannot
    follow) is not replayed: its missing key once stood for "no mask" in the signature, and the call after a
    no-mask call of the same shapes returned the no-mask answer."""
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))

    class Box:
        ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])

    box = Box()
    m = masks.causal() & masks.from_mod(lambda b, h, qi, kv: box.ids[qi] == box.ids[kv])
    assert m.cache_key() is None
    for _ in range(2):
        attnkit.attention(q, k, v)  # learns the no-mask signature
        spy.clear()
        out = attnkit.attention(q, k, v, mask=m)
        assert spy == [False]
        ref, _ = golden(q, k, v, mask=m)
        assert (out - torch.as_tensor(ref)).abs().max().item() <= 1e-12
        box.ids = torch.tensor([0, 0, 1, 1, 1, 1, 2, 2])  # the data it reads changes: still its own answer


USER_MASKS = [  # (name, make(L)): masks a user writes, each with a content key
    ("mask_mod", lambda L: masks.from_mod(lambda b, h, qi, kv: kv <= qi)),
    ("a bare mask_mod", lambda L: (lambda b, h, qi, kv: (qi - kv).abs() <= 9)),
    ("&", lambda L: masks.causal() & masks.from_mod(lambda b, h, qi, kv: kv % 3 != 1)),
    ("| and ~", lambda L: ~masks.from_mod(lambda b, h, qi, kv: kv > qi) | masks.from_mod(lambda b, h, qi, kv: kv < 4)),
    ("plan", lambda L: attnkit.plan(masks.from_mod(lambda b, h, qi, kv: qi // 16 == kv // 16), L=L)),
]


@pytest.mark.parametrize("name, make", USER_MASKS, ids=[m[0] for m in USER_MASKS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_users_masks_are_replayed_and_equal_the_full_path(name, make, dtype, spy, kernel_takes_bf16):
    """A mask the user writes (a mask_mod, bare or in & | ~, a plan of one) is replayed by its content key, built
    anew every call as a model does: bit for bit the full path's answer at any layout, within budget of golden."""
    require_kernel()
    g = torch.Generator().manual_seed(21)
    L = 70
    with torch.no_grad():
        for step in range(4):
            q, k, v = (_layout(torch.randn(2, 4, L, 16, generator=g).to(dtype), "step2" if step % 2 else "bshd")
                       for _ in range(3))
            mask = make(L)
            spy.clear()
            out = attnkit.attention(q, k, v, mask=mask)
            if step:
                assert spy == [True], name
            assert torch.equal(out, _full(q, k, v, mask=mask)), (name, step)
            ref, _ = golden(q, k, v, mask=mask)
            tol = 4e-2 if dtype == torch.bfloat16 else budget(dtype, 16, L)
            assert (out.double() - ref).abs().max().item() <= tol, (name, step)


def test_a_mask_mod_reading_a_tensor_follows_its_edits(spy):
    """A mask_mod's key holds the content of the tensors it reads, taken at each call: ids edited in place give a
    new key (the call is decided afresh), and a model building new ids every step keeps only a few in the cache."""
    require_kernel()
    g = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(1, 2, 96, 16, generator=g) for _ in range(3))
    ids = torch.tensor([0] * 40 + [1] * 56)
    m = masks.from_mod(lambda b, h, qi, kv: (ids[qi] == ids[kv]) & (kv <= qi))
    with torch.no_grad():
        for step in range(3):
            spy.clear()
            known = set(_fast._REPLAY)
            out = attnkit.attention(q, k, v, mask=m)
            assert spy == [True], step
            assert (set(_fast._REPLAY) == known) == (step == 1), step  # step 1 replays; 2 (ids edited) learns anew
            ref, _ = golden(q, k, v, mask=m)
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 96), step
            if step == 1:
                ids[20:60] = 2  # in place
        for step in range(3 * _fast._BY_IDENTITY_MAX):
            mod = (lambda ids: lambda b, h, qi, kv: ids[qi] == ids[kv])((torch.arange(96) >= step).long())
            out = attnkit.attention(q, k, v, mask=mod)
            ref, _ = golden(q, k, v, mask=mod)
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 96), step
    assert len(_fast._BY_IDENTITY) <= _fast._BY_IDENTITY_MAX


def _table_mod(t):
    return lambda s, b, h, qi, kv: s + t[h, (qi - kv).clamp(0, t.shape[1] - 1)]


SCORE_MODS = [  # (name, make()): score_mods with a content key
    ("softcap written as a lambda", lambda: lambda s, b, h, qi, kv: 20.0 * torch.tanh(s / 20.0)),
    ("score_mods.softcap", lambda: score_mods.softcap(5.0)),
    ("score_mods.alibi", lambda: score_mods.alibi(positional.alibi_slopes(4))),
    ("score_mods.relative_bias", lambda: score_mods.relative_bias(torch.linspace(-1, 1, 36).reshape(4, 9))),
    ("a lambda reading a table", lambda: _table_mod(torch.linspace(-2, 2, 32).reshape(4, 8))),
]


@pytest.mark.parametrize("name, make", SCORE_MODS, ids=[m[0] for m in SCORE_MODS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_mods_are_replayed_without_gradients_and_equal_the_full_path(name, make, dtype, spy, kernel_takes_bf16):
    """A score_mod with a content key is replayed where no gradient is wanted (its program or ALiBi's slopes kept in
    the call record): bit for bit the full path's answer, within budget of golden; with gradients, the full path."""
    require_kernel()
    g = torch.Generator().manual_seed(23)
    L = 67
    with torch.no_grad():
        for step in range(3):
            q, k, v = (_layout(torch.randn(2, 4, L, 16, generator=g).to(dtype), "bshd" if step == 2 else
                               "contiguous") for _ in range(3))
            sm = make()
            spy.clear()
            out = attnkit.attention(q, k, v, causal=True, score_mod=sm)
            if step:
                assert spy == [True], name
            assert torch.equal(out, _full(q, k, v, causal=True, score_mod=sm)), (name, step)
            ref, _ = golden(q, k, v, causal=True, score_mod=sm)
            tol = 4e-2 if dtype == torch.bfloat16 else budget(dtype, 16, L, 4.0)
            assert (out.double() - ref).abs().max().item() <= tol, (name, step)
    # with gradients: replayed where the program reads no tensor (a soft cap); out and gradients as the full path's
    pure = "softcap" in name
    q.requires_grad_(True)
    for step in range(3):
        spy.clear()
        out = attnkit.attention(q, k, v, causal=True, score_mod=sm)
        if step:
            assert spy == [pure], name
        (dq,) = torch.autograd.grad(out.float().square().sum(), q)
        fout = _full(q, k, v, causal=True, score_mod=sm)
        (fdq,) = torch.autograd.grad(fout.float().square().sum(), q)
        assert torch.equal(out, fout) and torch.equal(dq, fdq), (name, step)


def test_a_score_mods_tensor_edited_in_place_gives_the_new_answer(spy):
    """ALiBi's slopes and a captured table, edited in place after a replayed call: the next call's key holds the new
    content; and a call with *another* tensor holding the old content replays the old record, which must read the
    old values (the record keeps copies, never the first call's tensor, which was edited since)."""
    require_kernel()
    g = torch.Generator().manual_seed(24)
    q, k, v = (torch.randn(1, 4, 40, 16, generator=g) for _ in range(3))
    tol = budget(torch.float32, 16, 40, 4.0)
    for make, t in ((score_mods.alibi, positional.alibi_slopes(4)),
                    (_table_mod, torch.linspace(-2, 2, 32).reshape(4, 8))):
        old = t.clone()
        with torch.no_grad():
            for _ in range(2):
                attnkit.attention(q, k, v, causal=True, score_mod=make(t))
            t.mul_(-3.0)  # in place
            for src in (t, t, old.clone(), old.clone()):  # the new content; then the old one in another tensor
                spy.clear()
                out = attnkit.attention(q, k, v, causal=True, score_mod=make(src))
                assert spy == [True]
                ref, _ = golden(q, k, v, causal=True, score_mod=make(src))
                assert (out.double() - ref).abs().max().item() <= tol


def test_a_replayed_score_mod_reading_out_of_range_raises(spy):
    """A captured tensor read at an index the ranges cannot bound is checked by the kernel at every visible point;
    the replayed record's flag is cleared and read on every call: each call raises as the full path (and torch's
    indexing) does, and an in-range mod of the same shapes is unaffected."""
    require_kernel()
    short, long_ = torch.linspace(0, 1, 20), torch.linspace(0, 1, 32)
    g = torch.Generator().manual_seed(25)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))
    with torch.no_grad():
        for _ in range(3):  # learned, then replayed: raises each time
            with pytest.raises(IndexError, match="out of range"):
                attnkit.attention(q, k, v, causal=True, score_mod=lambda s, b, h, qi, kv: s + short[qi])
        assert any(key[_fast._SCORE_AT] is not None and run is not None for key, run in _fast._REPLAY.items())
        for _ in range(2):
            out = attnkit.attention(q, k, v, causal=True, score_mod=lambda s, b, h, qi, kv: s + long_[qi])
            ref, _ = golden(q, k, v, causal=True, score_mod=lambda s, b, h, qi, kv: s + long_[qi])
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 32, 4.0)


def test_flex_attention_block_mask_is_read_once_per_content(spy):
    """A BlockMask passed to flex_attention call after call is read into a plan once (by its content) and the
    call replayed; its index tensors edited in place give a new plan, and the answer follows."""
    require_kernel()
    from attnkit import _blockmask

    g = torch.Generator().manual_seed(26)
    q, k, v = (torch.randn(2, 4, 128, 16, generator=g) for _ in range(3))
    bm = attnkit.create_block_mask(lambda b, h, qi, kv: kv <= qi, None, None, 128, 128, BLOCK_SIZE=64)
    with torch.no_grad():
        for step in range(3):
            spy.clear()
            out = attnkit.flex_attention(q, k, v, block_mask=bm)
            if step:
                assert spy == [True]
            ref, _ = golden(q, k, v, mask=bm)
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 128), step
        before = len(_blockmask._PLANS)
        bm.kv_num_blocks[0, 0, 1] = 0  # in place: query block 1 loses its partial (diagonal) block
        out = attnkit.flex_attention(q, k, v, block_mask=bm)
        ref, _ = golden(q, k, v, mask=bm)
        assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 128)
        assert (out - attnkit.flex_attention(q, k, v, block_mask=bm)).abs().max() == 0  # replayed: the same
        assert len(_blockmask._PLANS) == min(before + 1, _blockmask._PLANS_MAX)


def test_content_key_reads_values_not_memory():
    """A tensor's content key: equal for equal values at any layout, lazy conjugate / negative bits resolved;
    none for a tensor not on the CPU or too large to hash on every call."""
    from attnkit import _mods

    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    key = _mods.content_key(a)
    assert _mods.content_key(a.t().contiguous().t()) == key  # same values, column-major memory
    assert _mods.content_key(a.clone()) == key
    assert _mods.content_key(a + 1) != key
    assert _mods.content_key(torch.empty(0))[:4] == ("tensor", "torch.float32", (0,), False)
    # whether it wants a gradient is part of the content: a call learned with a frozen table is not replayed for a
    # trainable one of the same values
    assert _mods.content_key(a.clone().requires_grad_()) != key
    c = torch.tensor([1 + 2j, 3 - 1j])
    assert _mods.content_key(c.conj()) == _mods.content_key(c.conj().resolve_conj())
    assert _mods.content_key(c.conj()) != _mods.content_key(c)
    assert _mods.content_key(torch.zeros(1, device="meta")) is None


_VALID = torch.arange(300) % 7 != 3  # keys some rows may not see (a padding pattern a mask_mod reads)

DECODE_MODS = [  # (name, mask_mod at S = 300, the kernel auto should pick)
    ("window as a mod", lambda b, h, qi, kv: (qi + 299 - kv >= 0) & (qi + 299 - kv < 40), "native-decode"),
    ("causal & a mod", masks.causal() & masks.from_mod(lambda b, h, qi, kv: kv >= 100), "native-decode"),
    ("a window per head", lambda b, h, qi, kv: (qi + 299 - kv >= 0) & (qi + 299 - kv < 30 * (h + 1)), "sdpa"),
    ("holes read from a tensor", lambda b, h, qi, kv: _VALID[kv] & (kv <= qi + 297), "sdpa"),
]


@pytest.mark.parametrize("name, mod, kernel", DECODE_MODS, ids=[m[0] for m in DECODE_MODS])
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_a_users_mask_mod_is_replayed_and_exact(name, mod, kernel, L, dtype, spy):
    """A decode step with the user's own mask_mod: one stretch of keys per row (the same for every head) runs on
    the compiled decode entry, its rows read off the mod's tile map; any other pattern on SDPA with the dense mask
    built once per signature. Replayed from the second call, bit for bit the full path, within budget of golden."""
    require_kernel()
    g = torch.Generator().manual_seed(27)
    with torch.no_grad():
        for step in range(3):
            q = torch.randn(2, 8, L, 16, generator=g).to(dtype)
            k, v = (_layout(torch.randn(2, 2, 300, 16, generator=g).to(dtype), "bshd" if step else "contiguous")
                    for _ in range(2))
            spy.clear()
            out = attnkit.attention(q, k, v, mask=mod)
            if step:
                assert spy == [True], name
            assert attnkit.dispatch(q, k, v, mask=mod).kernel.name == kernel
            assert torch.equal(out, _full(q, k, v, mask=mod)), (name, step)
            ref, _ = golden(q, k, v, mask=mod)
            tol = 4e-2 if dtype == torch.bfloat16 else budget(dtype, 16, 300)
            assert (out.double() - ref).abs().max().item() <= tol, (name, step)


def test_a_mod_reading_a_user_modules_attribute_follows_its_changes(spy):
    """A mask_mod reading ``cfg.W`` of a user's module: the module's attribute can be reassigned between calls, so
    the mod has no key (a library's module, ``torch`` or ``math``, keeps one) and every call sees the new value.
    Before, the module entered the key by its name and the call after ``cfg.W = 2`` replayed the tiles of W = 8."""
    import sys
    import types

    cfg = types.ModuleType("attnkit_test_cfg")
    cfg.W = 8  # type: ignore[attr-defined]
    sys.modules[cfg.__name__] = cfg
    try:
        exec("import attnkit_test_cfg as C\ndef mod(b, h, qi, kv):\n    return (qi - kv >= 0) & (qi - kv < C.W)\n",
             ns := {})
        mod = ns["mod"]
        from attnkit import _mods

        assert _mods.value_key(mod) is None
        assert _mods.value_key(lambda b, h, qi, kv: torch.where(qi >= kv, True, False)) is not None
        g = torch.Generator().manual_seed(28)
        q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
        with torch.no_grad():
            for w in (8, 8, 2, 5):
                cfg.W = w  # type: ignore[attr-defined]
                out = attnkit.attention(q, k, v, mask=mod)
                ref, _ = golden(q, k, v, mask=mod)
                assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 40), w
    finally:
        del sys.modules[cfg.__name__]


def test_a_mod_reading_a_bound_method_is_keyed_by_its_object():
    """A builtin method bound to an object (``lst.__getitem__``, ``t.clamp``) reads that object: the key holds the
    object's own key (a tensor's content) or there is none (a list), never the method's name alone."""
    from attnkit import _mods

    lst = [0, 1]
    t = torch.arange(4)
    assert _mods.value_key(lambda b, h, qi, kv: lst.__getitem__(0) + qi) is None  # reads a list: no key
    get = lst.__getitem__
    assert _mods.value_key(lambda b, h, qi, kv: get(0) + qi) is None
    clamp = t.clamp
    before = _mods.value_key(lambda b, h, qi, kv: clamp(0, 2)[qi] > kv)
    assert before is not None
    t[0] = 7  # in place: the bound method's object changed, so does the key
    assert _mods.value_key(lambda b, h, qi, kv: clamp(0, 2)[qi] > kv) != before
    assert _mods.value_key(lambda b, h, qi, kv: torch.where(qi > kv, True, False)) is not None  # a library's


_W = 4


def test_what_a_mod_reads_anywhere_is_in_its_key(spy):
    """Found in review, each a stale replay before the fix: a global read only inside a nested lambda or a
    comprehension; a function used as a settings holder (``cfg.W``); 0.0 against -0.0 in a closure (equal numbers,
    different values: ``copysign``); a subclass of a built-in score mod or mask inheriting its key."""
    global _W
    import math

    g = torch.Generator().manual_seed(29)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    tol = budget(torch.float32, 16, 40, 4.0)

    def check(**kw):
        with torch.no_grad():
            for _ in range(2):
                out = attnkit.attention(q, k, v, **kw)
                ref, _ = golden(q, k, v, **kw)
                assert (out.double() - ref).abs().max().item() <= tol, kw

    def nested(b, h, qi, kv):
        inner = lambda d: d <= _W  # noqa: E731  # _W read only by the inner lambda
        return inner((qi - kv).abs())

    def cfg():
        pass

    old = _W
    try:
        for w in (4, 30):
            _W = w
            check(mask=nested)
            cfg.W = w  # type: ignore[attr-defined]
            check(mask=lambda b, h, qi, kv: (qi - kv).abs() <= cfg.W)
    finally:
        _W = old
    for zero in (0.0, -0.0):
        check(mask=(lambda z: lambda b, h, qi, kv: (qi - kv) * math.copysign(1.0, z) >= 0)(zero))
        check(causal=True, score_mod=(lambda z: lambda s, b, h, qi, kv: s * math.copysign(1.0, z))(zero))

    class Flip(score_mods.Softcap):
        def __call__(self, s, b, h, q_idx, kv_idx):
            return -self.cap * torch.tanh(s / self.cap)

    class Shifted(masks.Causal):
        def bind(self, L, S):
            return lambda b, h, qi, kv: kv <= qi - 2

    check(causal=True, score_mod=score_mods.softcap(2.0))
    check(causal=True, score_mod=Flip(2.0))
    assert Flip(2.0).cache_key() is None and Shifted().cache_key() is None
    assert score_mods.softcap(0.0 + 2.0).cache_key() is not None


def test_a_block_masks_plan_reads_this_calls_mask_mod():
    """A BlockMask's plan is kept under its content; a later BlockMask of the same content gets a plan around *its*
    mask_mod, not the first one's (which read a tensor edited in place since: a stale answer before the fix)."""
    g = torch.Generator().manual_seed(30)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(3))
    doc1 = torch.tensor([0] * 50 + [1] * 78)
    bm1 = attnkit.create_block_mask(lambda b, h, qi, kv: doc1[qi] == doc1[kv], None, None, 128, 128, BLOCK_SIZE=64)
    with torch.no_grad():
        attnkit.flex_attention(q, k, v, block_mask=bm1)
        doc2 = doc1.clone()
        doc1[:] = torch.tensor([0] * 100 + [1] * 28)  # the first mod now reads other ids
        bm2 = attnkit.create_block_mask(lambda b, h, qi, kv: doc2[qi] == doc2[kv], None, None, 128, 128,
                                        BLOCK_SIZE=64)
        for _ in range(2):
            out = attnkit.flex_attention(q, k, v, block_mask=bm2)
            ref, _ = golden(q, k, v, mask=bm2)
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 128)


def test_random_mods_have_no_key_and_tensor_reading_masks_are_not_replayed_with_gradients(spy):
    """A mod drawing random numbers is no value (each call another mask): it has no key. With gradients the replay
    keeps the first call's request, whose mask object the backward's exact-rows fix reads: a mask reading a tensor
    (which may be edited in place between calls) is not replayed then; without gradients it is (its tiles are
    copies keyed by content)."""
    from attnkit import _mods

    assert _mods.value_key(lambda b, h, qi, kv: torch.rand(()) > 0.5) is None
    assert _mods.value_key(lambda s, b, h, qi, kv: s + torch.randn_like(s)) is None
    assert _mods.value_key(lambda b, h, qi, kv: torch.randint(0, 2, ()) > 0) is None
    require_kernel()
    ids = torch.tensor([0] * 30 + [1] * 40)
    mod = masks.from_mod(lambda b, h, qi, kv: (ids[qi] == ids[kv]) & (kv <= qi))
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(1, 2, 70, 16, generator=g, requires_grad=True) for _ in range(3))
    for grad, want in ((True, False), (False, True)):
        with torch.set_grad_enabled(grad):
            for step in range(2):
                spy.clear()
                out = attnkit.attention(q, k, v, mask=mod)
                assert spy == [want], (grad, step)
                ref, _ = golden(q, k, v, mask=mod)
                assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 70)


# ---- a decode loop: one key more every step (the family of a signature, without S) ---------------------------

GROWING = {
    "no mask": lambda: {},
    "causal": lambda: {"mask": masks.causal()},
    "causal=True": lambda: {"causal": True},
    "window 40": lambda: {"mask": masks.sliding_window(40)},
    "chunked 64": lambda: {"mask": masks.chunked(64)},
    "prefix_lm 30": lambda: {"mask": masks.prefix_lm(30)},
    "padding": lambda: {"mask": masks.padding([45, 30])},
    "window 60 (as wide as the first caches: plain causal there)": lambda: {"mask": masks.sliding_window(60)},
    "causal=True & window 70": lambda: {"causal": True, "mask": masks.sliding_window(70)},
    "causal + softcap": lambda: {"mask": masks.causal(), "score_mod": score_mods.softcap(5.0)},
    "causal + alibi": lambda: {"mask": masks.causal(), "score_mod": score_mods.alibi(positional.alibi_slopes(8))},
    "window + a lambda reading a table": lambda: {"mask": masks.sliding_window(50),
                                                  "score_mod": lambda s, b, h, q, kv: s + BIAS[kv % 97]},
}
BIAS = torch.randn(97)


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("name", sorted(GROWING))
def test_a_decode_loop_of_growing_caches_is_replayed_for_every_length_and_exact(name, L, spy):
    """A cache one key longer every step (S = 50 .. 140, across the score program's powers of two 64 and 128): the
    first step takes the full path, the later ones run the decode entry's call prepared for the signature without
    S (one learned signature per program bound, not one per step), each step equal to the float64 golden."""
    _fast.clear()
    kw = GROWING[name]()
    g = torch.Generator().manual_seed(L)
    cache_k, cache_v = torch.randn(2, 2, 200, 32, generator=g), torch.randn(2, 2, 200, 32, generator=g)
    q = torch.randn(2, 8, L, 32, generator=g)
    learned = []
    for S in range(50, 141):
        k, v = cache_k[:, :, :S], cache_v[:, :, :S]  # views into a preallocated cache, as a KV cache holds them
        before = len(_fast._REPLAY)
        out = attnkit.attention(q, k, v, **kw)
        learned.append(len(_fast._REPLAY) - before)
        ref, _ = golden(q, k, v, **kw)
        tol = budget(torch.float32, 32, S) + 8 * torch.finfo(torch.float32).eps * S * 0.25
        assert (out.double() - ref).abs().max().item() <= tol, (name, S)
    assert all(spy), f"{name}: every step answered by the fast path"
    assert sum(learned) <= 4, f"{name}: {sum(learned)} signatures learned over 91 steps (the family serves the rest)"


def test_a_family_follows_a_captured_tensor_edited_between_steps(spy):
    """The family is keyed by the score_mod's content (its tensors' digest): an edit between steps is seen."""
    _fast.clear()
    bias = torch.zeros(300)
    mod = lambda s, b, h, q, kv: s + bias[kv]  # noqa: E731
    cache_k, cache_v = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    q = torch.randn(1, 4, 1, 16)
    for S in range(100, 140):
        k, v = cache_k[:, :, :S], cache_v[:, :, :S]
        out = attnkit.attention(q, k, v, mask=masks.causal(), score_mod=mod)
        ref, _ = golden(q, k, v, mask=masks.causal(), score_mod=mod)
        assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S), S
        bias[S % 300] += 5.0


def test_closed_form_row_intervals_are_the_masks_own():
    """Full, causal, window, chunked, prefix-LM compute their row intervals in NumPy (a decode loop asks at every
    step): int32, contiguous, clamped to [0, S], equal to the mask's dense form at every alignment and L > S."""
    for m in (masks.full(), masks.causal(), masks.causal("top_left"), masks.sliding_window(5),
              masks.sliding_window(3, "top_left"), masks.chunked(4), masks.prefix_lm(6)):
        for L, S in ((1, 1), (1, 13), (5, 13), (13, 13), (20, 7)):
            if isinstance(m, masks.PrefixLM) and m.prefix_length > S:
                continue  # (refused by its validate)
            lo, hi = m.row_intervals(1, L, S)
            assert lo.dtype == hi.dtype == torch.int32 and lo.is_contiguous() and hi.is_contiguous()
            j = torch.arange(S)
            mine = (j >= lo[0, :, None]) & (j < hi[0, :, None])
            assert torch.equal(mine, m.materialize(1, 1, L, S).reshape(L, S)), (m, L, S)
            assert int(lo.min()) >= 0 and int(hi.max()) <= S


def test_a_family_checks_each_length_as_the_full_path_does(spy):
    """A padding mask's lengths must fit the cache: learned at S = 60, a later step with S = 40 raises the full
    path's ValueError (never a silent clamp); a prefix-LM prefix longer than S likewise."""
    _fast.clear()
    cache_k, cache_v = torch.randn(2, 2, 100, 16), torch.randn(2, 2, 100, 16)
    q = torch.randn(2, 4, 1, 16)
    for mask, bad_s in ((masks.padding([50, 45]), 40), (masks.prefix_lm(55), 50)):
        for S in (60, 61, 62):
            attnkit.attention(q, cache_k[:, :, :S], cache_v[:, :, :S], mask=mask)
        with pytest.raises(ValueError, match=f"S={bad_s}"):
            attnkit.attention(q, cache_k[:, :, :bad_s], cache_v[:, :, :bad_s], mask=mask)


def test_learned_score_mods_are_never_replayed_or_cached_by_a_shared_key():
    """A built-in score mod without a content key (learned ALiBi slopes, a learned or huge relative-bias table) has
    no key at all: before, its key was ("score_mod", type, None), the same for every such mod, so a call under
    no_grad replayed the first call's copy of the slopes after an optimizer's in-place step (error 2.4), and a
    second table ran the first one's program (error 2.35-3.48), on the decode entry and the forward alike."""
    _fast.clear()
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)

    def check(q, backend="auto", **kw):
        out = attnkit.attention(q, k, v, backend=backend, **kw)
        ref, _ = golden(q, k, v, **kw)
        assert (out.double() - ref).abs().max().item() <= 2e-5, kw

    slopes = torch.rand(8).requires_grad_()
    q1 = torch.randn(1, 8, 1, 16)
    with torch.no_grad():
        check(q1, causal=True, score_mod=score_mods.alibi(slopes))
        slopes.mul_(5.0)  # an optimizer step between two generations
        check(q1, causal=True, score_mod=score_mods.alibi(slopes))
        check(q1, causal=True, score_mod=score_mods.alibi(torch.rand(8).mul(4).requires_grad_()))
    t1, t2 = torch.randn(8, 41).requires_grad_(), (torch.randn(8, 41) * 5).requires_grad_()
    for L in (1, 40):
        q = torch.randn(1, 8, L, 16)
        for t in (t1, t2):
            with torch.no_grad():
                check(q, score_mod=score_mods.relative_bias(t), backend="tiled")
    assert score_mods.builtin_key(score_mods.relative_bias(t1)) is None
    # grad mode after a no_grad call: the program with the table's gradient, on the compiled kernel
    q = torch.randn(1, 8, 40, 16)
    d = attnkit.dispatch(q, k, v, score_mod=score_mods.relative_bias(t1))
    assert d.worker == "native", d


def test_a_subclass_of_alibi_runs_its_own_call():
    """A subclass of score_mods.Alibi may compute something else: it runs as its traced program, not as ALiBi's
    slopes (before: plain ALiBi, error 1.4-2.4, on the decode entry and the forward)."""
    class Symmetric(score_mods.Alibi):
        def __call__(self, score, b, h, q_idx, kv_idx):
            return score - self.slopes[h] * (kv_idx - q_idx).abs().to(score.dtype)

    mod = Symmetric(positional.alibi_slopes(8))
    k, v = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
    for L in (1, 4, 40):
        q = torch.randn(1, 8, L, 16)
        out = attnkit.attention(q, k, v, score_mod=mod)
        ref, _ = golden(q, k, v, score_mod=mod)
        assert (out.double() - ref).abs().max().item() <= 2e-5, L


def test_huge_window_and_chunk_sizes():
    """A window wider than int64's range is the whole prefix at every step of a loop (its row intervals clamp the
    size first); a chunk size past 2**62 is refused by name (torch's int64 division would overflow)."""
    _fast.clear()
    ck, cv, q = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 8, 1, 16)
    for m in (masks.sliding_window(2 ** 70), masks.sliding_window(2 ** 63, "top_left"), masks.chunked(2 ** 62)):
        for S in (30, 31, 32):
            out = attnkit.attention(q, ck[:, :, :S], cv[:, :, :S], mask=m)
            ref, _ = golden(q, ck[:, :, :S], cv[:, :, :S], mask=m)
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S), (m, S)
    with pytest.raises(ValueError, match=r"size: expected an int <= 2\*\*62"):
        masks.chunked(2 ** 63)


def test_a_familys_block_of_rows_equals_the_masks_row_intervals_at_each_length():
    """The decode family evaluates a closed-form mask's rows for 64 key counts at once (``_edges_block``): each row
    equals ``row_intervals`` of the parts' ``&`` at its S, for every closed-form mask and alignment, alone and with
    causal on top, at L above and below S, and windows / chunks wider than int64."""
    from attnkit.backends.native import _BLOCK, _edges_block

    singles = [masks.full(), masks.causal(), masks.causal("top_left"), masks.sliding_window(5),
               masks.sliding_window(3, "top_left"), masks.sliding_window(2 ** 70), masks.chunked(4),
               masks.chunked(7, "top_left"), masks.chunked(2 ** 62), masks.prefix_lm(6)]
    for m in singles:
        for parts in ([m], [masks.causal(), m]):
            for L in (1, 3, 16):
                for S0 in (1, 5, 60):
                    lo, hi = _edges_block(parts, L, S0)
                    assert lo.shape == hi.shape == (_BLOCK, L) and lo.flags.c_contiguous
                    for i in range(0, _BLOCK, 7):
                        S = S0 + i
                        if isinstance(m, masks.PrefixLM) and m.prefix_length > S:
                            continue
                        ref = (parts[0] if len(parts) == 1 else masks.And(*parts)).row_intervals(1, L, S)
                        assert torch.equal(torch.from_numpy(lo[i:i + 1]), ref[0].expand(1, L)), (parts, L, S)
                        assert torch.equal(torch.from_numpy(hi[i:i + 1]), ref[1].expand(1, L)), (parts, L, S)


# ---- a decode loop whose mask_mod is new at every step (the step's offset captured) -------------------------------

def _count_learning(monkeypatch) -> list:
    """The signatures the full path learns from here on (``_fast._learn`` calls), in a list."""
    real, seen = _fast._learn, []

    def learn(key, *a):
        seen.append(key)
        return real(key, *a)

    monkeypatch.setattr(_fast, "_learn", learn)
    return seen


_DOC = torch.repeat_interleave(torch.arange(40), 7)  # 280 keys: documents of 7 tokens


def _stepping_mods(S: int, L: int) -> dict:
    """mask_mods as a FlexAttention decode loop writes them: built at each step with the query's offset ``S - L``."""
    off = S - L
    lens = torch.tensor([S - 3, S - 11])
    return {  # name -> (mask keyword, whether every row is one stretch of keys, the same for every head)
        "causal as a mod": (lambda b, h, q, kv: kv <= q + off, True),
        "window 40 as a mod": (lambda b, h, q, kv: (kv <= q + off) & (kv > q + off - 40), True),
        "padding lengths per batch row": (lambda b, h, q, kv: (kv < lens[b]) & (kv <= q + off), True),
        "documents read from a tensor": (lambda b, h, q, kv: (_DOC[kv] == _DOC[q + off]) & (kv <= q + off), True),
        "the same window at every head": (lambda b, h, q, kv: (kv <= q + off + 0 * h) & (kv > q + off - 25), True),
        "from_mod(...) & a built-in": (masks.from_mod(lambda b, h, q, kv: kv <= q + off) & masks.sliding_window(33),
                                       True),
        "nothing seen (dead rows)": (lambda b, h, q, kv: kv > q + off + 5, True),
        "a window per head": (lambda b, h, q, kv: (kv <= q + off) & (kv > q + off - 10 * (h + 1)), False),
        "a sink and a window (two stretches)": (lambda b, h, q, kv: ((kv <= q + off) & (kv > q + off - 20)) | (kv < 4),
                                                False),
    }


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("name", sorted(_stepping_mods(100, 1)))
def test_a_decode_loop_with_a_new_mask_mod_every_step_is_served_and_exact(name, L, causal, spy, monkeypatch):
    """S = 50 .. 130, a new mod object each step: every step equals the float64 golden (dead rows 0); a mod whose
    rows are one stretch each is served by the family of its code (a few signatures learned, not one per step);
    the others take the full path, exact too."""
    require_kernel()
    _fast.clear()
    g = torch.Generator().manual_seed(L)
    cache_k, cache_v = torch.randn(2, 2, 200, 16, generator=g), torch.randn(2, 2, 200, 16, generator=g)
    q = torch.randn(2, 8, L, 16, generator=g)
    learned = _count_learning(monkeypatch)
    with torch.no_grad():
        for S in range(50, 131):
            mod, one_stretch = _stepping_mods(S, L)[name]
            k, v = cache_k[:, :, :S], cache_v[:, :, :S]
            out = attnkit.attention(q, k, v, mask=mod, causal=causal)
            ref, _ = golden(q, k, v, mask=mod, causal=causal)
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S), (name, S)
    if one_stretch:
        assert len(learned) <= 3, f"{name}: {len(learned)} learned over 81 steps (the family serves the rest)"


def test_the_same_new_mod_at_every_layer_of_a_step_is_evaluated_once(spy, monkeypatch):
    """A model passes one step's mod to each of its layers: the first layer's call evaluates it (the family), the
    others replay that exact signature (its mod's content and S fixed); a captured tensor edited between two layers
    is a new content, evaluated again. Every call exact."""
    require_kernel()
    from attnkit.backends import native

    _fast.clear()
    real, evaluated = native._dense_points, []
    monkeypatch.setattr(native, "_dense_points", lambda *a, **kw: evaluated.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(8)
    caches = [(torch.randn(1, 2, 150, 16, generator=g), torch.randn(1, 2, 150, 16, generator=g)) for _ in range(4)]
    q = torch.randn(1, 8, 1, 16, generator=g)
    lens = torch.tensor([0])
    with torch.no_grad():
        for S in range(60, 100):
            off = S - 1
            mod = lambda b, h, qi, kv, off=off: (kv <= qi + off) & (kv >= lens[b])  # noqa: E731
            lens[0] = S % 7
            before = len(evaluated)
            for layer, (ck, cv) in enumerate(caches):
                if layer == 2 and S % 5 == 0:
                    lens[0] += 3  # edited between two layers: the next layers see the new lengths
                k, v = ck[:, :, :S], cv[:, :, :S]
                out = attnkit.attention(q, k, v, mask=mod)
                ref, _ = golden(q, k, v, mask=mod)
                assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S), (S, layer)
            if S > 61:
                assert len(evaluated) - before == (2 if S % 5 == 0 else 1), S


def test_a_mod_that_edits_its_index_tensors_in_place_shifts_no_later_call(spy):
    """The decode family evaluates mods on shared index tensors: a mod that writes them in place (``kv.add_``) is
    detected (their version counter), its call goes to the full path, and the next call's indices are intact."""
    require_kernel()
    _fast.clear()
    cache_k, cache_v = torch.randn(1, 2, 120, 16), torch.randn(1, 2, 120, 16)
    q = torch.randn(1, 4, 1, 16)
    with torch.no_grad():
        for S in range(60, 80):
            off = S - 1
            good = lambda b, h, qi, kv, off=off: kv <= qi + off - 7  # noqa: E731
            bad = lambda b, h, qi, kv, off=off: (kv.add_(3) - 3) <= qi + off - 5  # noqa: E731
            for mod in (good, bad, good):
                k, v = cache_k[:, :, :S], cache_v[:, :, :S]
                out = attnkit.attention(q, k, v, mask=mod)
                ref, _ = golden(q, k, v, mask=lambda b, h, qi, kv, d=(7 if mod is good else 5), off=off:
                                kv <= qi + off - d)
                assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S), S


@pytest.mark.parametrize("how", ["add_", "data", "numpy"])
def test_a_mod_writing_its_indices_unseen_by_the_version_counter_shifts_no_later_call(how, spy):
    """Writes through ``.data`` or a NumPy view bump no version counter: the index arange is compared by content
    after each evaluation, so a later, plain mod still sees 0 .. S - 1 (a float64-exact answer)."""
    require_kernel()
    _fast.clear()
    g = torch.Generator().manual_seed(11)
    q, k, v = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 100, 16, generator=g), torch.randn(
        1, 2, 100, 16, generator=g)

    def bad(b, h, qi, kv):
        if how == "add_":
            kv.add_(7)
        elif how == "data":
            kv.data.add_(7)
        else:
            kv.numpy()[...] += 7
        return kv <= qi + 50

    def plain(b, h, qi, kv):
        return kv < 30

    with torch.no_grad():
        attnkit.attention(q, k, v, mask=bad)
        for _ in range(2):
            out = attnkit.attention(q, k, v, mask=plain)
            ref, _ = golden(q, k, v, mask=plain)
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, 100), how


def test_a_mod_first_evaluated_under_inference_mode_keeps_the_decode_entry():
    """The index arange is a normal tensor even when a thread first builds it under ``torch.inference_mode()``: the
    decode entry serves user mods there and afterwards (an inference tensor's version counter cannot be read)."""
    require_kernel()
    import threading

    got = []
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 100, 16), torch.randn(1, 4, 100, 16)
    mod = lambda b, h, qi, kv: kv <= qi + 50  # noqa: E731

    def work():  # a fresh thread: its index arange is built inside inference_mode
        with torch.inference_mode():
            got.append(attnkit.dispatch(q, k, v, mask=mod).kernel.name)
            out = attnkit.attention(q, k, v, mask=mod)
        got.append(attnkit.dispatch(q, k, v, mask=mod).kernel.name)
        ref, _ = golden(q, k, v, mask=mod)
        got.append((out.double() - ref).abs().max().item())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert got[:2] == ["native-decode", "native-decode"]
    assert got[2] <= budget(torch.float32, 16, 100)


def test_a_family_of_mods_refuses_what_the_full_path_refuses(spy):
    """A mod of the family's code that returns no bool at a later step raises the full path's TypeError."""
    _fast.clear()
    cache_k, cache_v = torch.randn(1, 2, 120, 16), torch.randn(1, 2, 120, 16)
    q = torch.randn(1, 4, 1, 16)

    def mod_at(S, as_int):
        return lambda b, h, qi, kv: (kv <= qi + S - 1).int() if as_int else kv <= qi + S - 1

    with torch.no_grad():
        for S in range(60, 70):
            attnkit.attention(q, cache_k[:, :, :S], cache_v[:, :, :S], mask=mod_at(S, False))
        with pytest.raises(TypeError, match="bool"):
            attnkit.attention(q, cache_k[:, :, :70], cache_v[:, :, :70], mask=mod_at(70, True))


@pytest.mark.parametrize("L", [1, 3, 16])
@pytest.mark.parametrize("S", [1, 63, 64, 65, 300])
def test_dense_row_intervals_equal_the_tile_maps(L, S):
    """The decode entry's rows of a mod evaluated at every point equal those read off its tile map (or both None)."""
    from attnkit.backends import _tilebits, native

    ids = torch.arange(S) // 5
    mods = [lambda b, h, q, kv: kv <= q + S - L, lambda b, h, q, kv: (kv <= q + S - L) & (kv > q + S - L - 9),
            lambda b, h, q, kv: ids[kv] == ids[(q + S - L).clamp(min=0)], lambda b, h, q, kv: kv < 0,
            lambda b, h, q, kv: (kv % 2 == 0), lambda b, h, q, kv: kv < 3 + b, lambda b, h, q, kv: kv <= h + q,
            lambda b, h, q, kv: (q >= 0) & (kv >= 0),
            # one row for every query (read off its bytes): one key, every key, the last few, a hole
            lambda b, h, q, kv: kv == S // 2, lambda b, h, q, kv: kv >= 0, lambda b, h, q, kv: kv >= S - 4,
            lambda b, h, q, kv: (kv < 2) | (kv > 4),
            lambda b, h, q, kv: q >= 1]  # (the last: no key dim, dead row 0)
    j = torch.arange(S)
    for i, fn in enumerate(mods):
        m = masks.from_mod(fn)
        dense = native._dense_row_intervals(m, 2, 4, L, S)
        tiles = _tilebits.row_intervals(_tilebits.tile_bits(m, 2, 4, L, S), L, S)
        points = m.materialize(2, 4, L, S)  # (2, 4, L, S)
        stretches = [(r.nonzero().flatten().tolist()) for r in points.reshape(-1, S)]
        one = all(not x or x[-1] - x[0] + 1 == len(x) for x in stretches) and bool((points == points[:, :1]).all())
        assert (dense is not None) == one, (i, L, S)
        if dense is not None:
            lo, hi = (t.expand(2, L) for t in dense)
            mine = (j >= lo[:, None, :, None]) & (j < hi[:, None, :, None])
            assert torch.equal(mine.expand(2, 4, L, S), points), (i, L, S)
            assert lo.dtype == hi.dtype == torch.int32
        if tiles is not None:  # where the tile map gives rows too (it refuses any mod reading h), the same
            assert dense is not None
            assert torch.equal(tiles[0].expand(2, L), dense[0].expand(2, L)), (i, L, S)
            assert torch.equal(tiles[1].expand(2, L), dense[1].expand(2, L)), (i, L, S)


# ---- FlexAttention's decode loop: a new BlockMask every step ------------------------------------------------------

def _flex_golden(q, k, v, mod):
    """float64 golden of FlexAttention's meaning of a block mask ``create_block_mask`` built: ``mod`` at every point."""
    return golden(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // k.shape[1], 1),
                  mask=mod)[0]


@pytest.mark.parametrize("block", [128, 64])
@pytest.mark.parametrize("L", [1, 3])
def test_flex_attention_decode_loop_with_a_new_block_mask_each_step(L, block, spy, monkeypatch):
    """``create_block_mask`` for this step's (L, S) and ``flex_attention``, one key more each step: the decode entry
    runs it (the BlockMask's rows as intervals), the family of its code serves the later steps, each step exact."""
    require_kernel()
    _fast.clear()
    g = torch.Generator().manual_seed(L + block)
    cache_k, cache_v = torch.randn(2, 2, 300, 16, generator=g), torch.randn(2, 2, 300, 16, generator=g)
    q = torch.randn(2, 8, L, 16, generator=g)
    learned = _count_learning(monkeypatch)
    with torch.no_grad():
        for S in range(100, 200):
            off = S - L
            mod = lambda b, h, qi, kv, off=off: (kv <= qi + off) & (kv > qi + off - 70)  # noqa: E731
            bm = attnkit.create_block_mask(mod, 2, None, L, S, BLOCK_SIZE=block)
            k, v = cache_k[:, :, :S], cache_v[:, :, :S]
            if S == 100:
                assert attnkit.dispatch(q, k, v, mask=attnkit._blockmask.block_mask_plan(
                    bm, 2, 8, L, S, q.device, "block_mask")).kernel.name == "native-decode"
            out = attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
            ref = _flex_golden(q, k, v, mod)
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S), S
    assert len(learned) <= 3, f"{len(learned)} signatures learned over 100 steps (the family serves the rest)"


def test_flex_attention_decode_over_a_static_cache_with_a_sliced_block_mask(spy):
    """gpt-fast's loop: one BlockMask for the whole cache built once, its query block sliced each step, the mod
    shifted by the position (a tensor), S fixed: exact at every step (the slice's meaning: its blocks, then the mod)."""
    require_kernel()
    _fast.clear()
    MAX = 260
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, 2, MAX, 16, generator=g), torch.randn(1, 2, MAX, 16, generator=g)
    q = torch.randn(1, 4, 1, 16, generator=g)
    causal = lambda b, h, qi, kv: qi >= kv  # noqa: E731
    whole = attnkit.create_block_mask(causal, 1, 1, MAX, MAX, BLOCK_SIZE=64)
    with torch.no_grad():
        for pos in range(100, 200, 3):
            m = whole[:, :, pos // 64]
            offset = torch.tensor(pos)
            m.mask_mod = lambda b, h, qi, kv, offset=offset: causal(b, h, qi + offset, kv)
            m.seq_lengths = (1, MAX)
            out = attnkit.flex_attention(q, k, v, block_mask=m, enable_gqa=True)
            ref = _flex_golden(q, k, v, lambda b, h, qi, kv, pos=pos: kv <= qi + pos)
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, MAX), pos


def test_a_block_mask_the_decode_entry_cannot_take_runs_elsewhere_exactly(spy, monkeypatch):
    """Blocks of 32 (not the kernel's 64 multiples): not the decode entry read as a plan; rows of two stretches (a
    sink and a window): the decode entry either way (the row sees their union); blocks listed with no mod
    (``from_kv_blocks``, never replayed: no content key): the decode entry (its one block is one stretch of keys).
    Exact all of them."""
    require_kernel()
    from torch.nn.attention.flex_attention import BlockMask

    g = torch.Generator().manual_seed(9)
    S = 200
    k, v = torch.randn(1, 2, S, 16, generator=g), torch.randn(1, 2, S, 16, generator=g)
    q = torch.randn(1, 4, 1, 16, generator=g)
    window = lambda b, h, qi, kv: kv > qi + S - 1 - 50  # noqa: E731
    sink = lambda b, h, qi, kv: (kv > qi + S - 1 - 50) | (kv < 4)  # noqa: E731
    blocks = BlockMask.from_kv_blocks(torch.tensor([[[1]]], dtype=torch.int32), torch.tensor([[[[1, 0]]]],
                                      dtype=torch.int32), BLOCK_SIZE=128, seq_lengths=(1, S))
    # (points off: the blocks read as a plan, as above the decode size; on: read off the mask's points, one stretch
    # per row for the window and the listed block, whatever the blocks)
    cases = [(attnkit.create_block_mask(window, 1, None, 1, S, BLOCK_SIZE=32), window, False, True),
             (attnkit.create_block_mask(sink, 1, None, 1, S), sink, True, True),
             (blocks, lambda b, h, qi, kv: (kv >= 128) & (kv < 256), True, True)]  # (its one block: one stretch)
    with torch.no_grad():
        for points, (bm, meaning, by_plan, by_points) in itertools.product((False, True), cases):
            bm = bm.to("cpu")  # (a copy: without the points a call kept on it before)
            monkeypatch.setattr(masks, "_SMALL_GRID_ROWS", 16 if points else 0)
            plan = attnkit._blockmask.block_mask_plan(bm, 1, 4, 1, S, q.device, "block_mask")
            decode = attnkit.dispatch(q, k, v, mask=plan).kernel.name == "native-decode"
            assert decode == (by_points if points else by_plan)
            for _ in range(2):
                out = attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
                ref = _flex_golden(q, k, v, meaning)
                assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S)


def test_the_index_check_compares_bytes_with_and_without_the_c_librarys_memcmp(monkeypatch):
    from attnkit.backends import native

    a, b = np.arange(100, dtype=np.int64), np.arange(100, dtype=np.int64)
    for memcmp in (native._MEMCMP, None):
        monkeypatch.setattr(native, "_MEMCMP", memcmp)
        b[:] = a
        assert native._same_bytes(a.ctypes.data, b.ctypes.data, 800)
        b[99] += 1
        assert not native._same_bytes(a.ctypes.data, b.ctypes.data, 800)
        assert native._same_bytes(a.ctypes.data, b.ctypes.data, 792)  # (only the first 99 compared)


def test_a_bool_row_holding_other_bytes_than_0_and_1_is_read_as_torch_reads_it():
    """A mod's bool result made by viewing uint8 data as bool (bytes of 2: True to torch and NumPy) gives the rows
    torch's own reading gives, on the decode entry's byte reading (which falls back to the general scan) and in
    create_block_mask's small-grid kinds."""
    from attnkit import masks as _m
    from attnkit.backends import native

    S = 300
    raw = torch.zeros(S, dtype=torch.uint8)
    raw[40:200] = 2
    raw[100] = 1

    def odd(b, h, q, kv):  # the key row as it is (indexing would copy it as 0 / 1)
        return raw.view(torch.bool)

    assert odd(0, 0, 0, 0).numpy().view(np.uint8).max() == 2  # the bytes the readers see
    lo, hi = native._dense_row_intervals(masks.from_mod(odd), 1, 2, 1, S)
    assert (lo.tolist(), hi.tolist()) == ([[40]], [[200]])
    raw[120] = 0  # a hole: two stretches
    assert native._dense_row_intervals(masks.from_mod(odd), 1, 2, 1, S) is None
    m = masks.from_mod(odd)
    for L, bm, bn in ((1, 128, 128), (3, 64, 32)):
        fast = _m._small_grid_kinds(m.bind(L, S), 1, 1, L, S, bm, bn)
        assert torch.equal(fast, _m._evaluated_kinds(m.bind(L, S), 1, 1, L, S, bm, bn))


@pytest.mark.parametrize("S", [1, 7, 300])
@pytest.mark.parametrize("L", [1, 3])
def test_a_decode_mods_0d_or_1d_result_runs_exactly(L, S):
    """A mod returning a 0-d bool (S = 1: ``torch.tensor(True)``, ``(kv < 5).all()``) or an ``(S,)`` row with holes
    (``row[kv.reshape(-1)]``) runs at decode sizes and equals the float64 golden: the decode entry's byte reader
    skips a 0-d result (it had raised IndexError, and SDPA then failed on the 0-d mask), and SDPA's dense mask of a
    mod's (S,) or 0-d result is made 4-d."""
    g = torch.Generator().manual_seed(L * 100 + S)
    q = torch.randn(2, 4, L, 16, generator=g)
    k, v = torch.randn(2, 2, S, 16, generator=g), torch.randn(2, 2, S, 16, generator=g)
    row = torch.rand(S, generator=g) < 0.5
    row[0] = True  # (no dead row: the golden's convention for one is tested elsewhere)
    mods = [lambda b, h, i, kv: row[kv.reshape(-1)], lambda b, h, i, kv: (kv >= 0).all()]
    if S == 1:
        mods.append(lambda b, h, i, kv: torch.tensor(True))
    for mod in mods:
        out = attnkit.attention(q, k, v, mask=mod)
        allowed = masks.from_mod(mod).materialize(2, 4, L, S)
        kk, vv = (t.double().repeat_interleave(2, dim=1) for t in (k, v))
        s = (q.double() @ kk.transpose(-2, -1)) / 4.0
        gold = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vv
        assert (out.double() - gold).abs().max().item() <= 16 * 2.0 ** -23 * (4 + S ** 0.5)


def test_the_zero_row_check_through_ctypes_as_through_the_vectorcall(monkeypatch):
    """A build without the extension's ``suspect_rows`` vectorcall checks through ctypes'
    ``ak_suspect_rows``: the same answers."""
    from attnkit.backends import _native

    require_kernel()
    out = torch.randn(2, 3, 40, 8) + 10
    fast = _native.suspect_rows_fn()
    monkeypatch.setattr(_native, "_suspect_rows", None)
    monkeypatch.setattr(_native, "_ext", None)
    slow = _native.suspect_rows_fn()
    assert slow is not fast
    for w in (out, out.transpose(1, 2)):
        assert fast(w) is slow(w) is False
        for value in (-0.0, float("nan")):
            z = w.clone()
            z[1, 2, 2, 0] = value
            assert fast(z) is slow(z) is True


def _bool_rows(B, L, S, lo, hi, shape):
    """A bool mask of rows [lo[b, i], hi[b, i]) of keys, viewed with ``shape``'s leading dims."""
    j = torch.arange(S)
    m = (j >= torch.as_tensor(lo)[..., None]) & (j < torch.as_tensor(hi)[..., None])  # (B', L, S)
    return m.reshape(shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_with_its_own_bool_mask_runs_on_the_decode_entry(dtype, spy):
    """A decode step's bool tensor mask whose rows are each one stretch of keys, the same for every head (key
    padding per batch row, a window, a dead row): attnkit's decode entry, its rows read off *this call's* mask —
    a loop with a new mask (and one key more) every step, and a mask edited in place between two calls of the same
    shape, each equal to the float64 golden within budget and to the full path bit for bit. Rows of two stretches
    run there too (a sink and a window: the row sees their union); rows of more than four stretches, or heads that
    differ, go to torch's kernel: the same answers. A score_mod (attnkit's soft cap, a
    user's lambda) on top runs there too."""
    require_kernel()
    g = torch.Generator().manual_seed(14)
    B, H, Hkv, D = 2, 4, 2, 16
    ck, cv = (torch.randn(B, Hkv, 200, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    tol = 4e-2 if dtype == torch.bfloat16 else budget(dtype, D, 200)
    with torch.no_grad():
        for S in range(120, 131):  # a decode loop: a new mask and one key more every step
            k, v = ck[:, :, :S], cv[:, :, :S]
            cases = {
                "one row (1, 1, 1, S)": _bool_rows(1, 1, S, [[3]], [[S]], (1, 1, 1, S)),
                "key padding per batch row (B, 1, 1, S)": _bool_rows(B, 1, S, [[0], [S - 50]], [[S - 7], [S]],
                                                                      (B, 1, 1, S)),
                "2-d (1, S)": _bool_rows(1, 1, S, [[S - 64]], [[S]], (1, S)),
                "a dead batch row": _bool_rows(B, 1, S, [[0], [0]], [[S], [0]], (B, 1, 1, S)),
                "heads alike (1, H, 1, S)": _bool_rows(1, 1, S, [[5]], [[S - 5]], (1, 1, 1, S)).expand(1, H, 1, S),
            }
            for what, m in cases.items():
                d = attnkit.dispatch(q, k, v, mask=m)
                assert d.verdicts[0] == ("native-decode", "runs"), (what, d.table())
                spy.clear()
                out = attnkit.attention(q, k, v, mask=m)
                ref, _ = golden(q, k, v, mask=m)
                assert_close(out, ref, tol, f"{what}, S = {S}")
                assert torch.equal(out, _full(q, k, v, mask=m)), (what, S)
        def capped(s, b, h, i, j):  # a user's score_mod (a traced program) on top of the call's bool mask
            return 20.0 * torch.tanh(s / 20.0)

        for sm in (score_mods.softcap(20.0), capped):
            for S in (140, 141):  # a new S: the family's call
                k, v = ck[:, :, :S], cv[:, :, :S]
                m = _bool_rows(B, 1, S, [[2], [S - 40]], [[S], [S - 3]], (B, 1, 1, S))
                assert attnkit.dispatch(q, k, v, mask=m, score_mod=sm).verdicts[0] == ("native-decode", "runs")
                out = attnkit.attention(q, k, v, mask=m, score_mod=sm)
                assert_close(out, golden(q, k, v, mask=m, score_mod=sm)[0], tol, f"{sm!r}, S = {S}")
                assert torch.equal(out, _full(q, k, v, mask=m, score_mod=sm)), (sm, S)
        k, v = ck[:, :, :150], cv[:, :, :150]
        m = _bool_rows(1, 1, 150, [[0]], [[150]], (1, 1, 1, 150))
        attnkit.attention(q, k, v, mask=m)
        spy.clear()
        m[..., 100:] = False  # edited in place: the same signature, other rows
        out = attnkit.attention(q, k, v, mask=m)
        assert spy == [True]
        assert_close(out, golden(q, k, v, mask=m)[0], tol, "edited in place")
        two = _bool_rows(1, 1, 150, [[0]], [[150]], (1, 1, 1, 150)) & (torch.arange(150) != 70)
        assert attnkit.dispatch(q, k, v, mask=two).kernel.name == "native-decode"
        assert_close(attnkit.attention(q, k, v, mask=two), golden(q, k, v, mask=two)[0], tol, "two stretches")
        for what, m in {"six stretches": _bool_rows(1, 1, 150, [[0]], [[150]], (1, 1, 1, 150)) & (
                            torch.arange(150) % 30 != 7),
                        "heads differ": torch.stack([_bool_rows(1, 1, 150, [[h]], [[150]], (1, 1, 150))
                                                     for h in range(H)], 1)}.items():
            d = attnkit.dispatch(q, k, v, mask=m)
            assert d.kernel is not None and d.kernel.name != "native-decode", (what, d.table())
            for _ in range(2):
                assert_close(attnkit.attention(q, k, v, mask=m), golden(q, k, v, mask=m)[0], tol, what)


def test_a_bool_mask_of_other_bytes_than_0_and_1_reads_as_true_on_the_decode_entry():
    """A uint8 buffer viewed as bool (bytes 2, 255: True to torch and NumPy) read off its bytes as True — a byte
    search for 1 would have seen a dead row or two stretches."""
    from attnkit.backends import native

    raw = torch.zeros(1, 1, 1, 90, dtype=torch.uint8)
    raw[..., 10:40] = torch.tensor([2, 255, 1] * 10, dtype=torch.uint8)
    m = raw.view(torch.bool)
    assert native._bool_row_intervals(m, 1, 90, spans=True) == (10, 40)
    lo, hi = native._bool_row_intervals(m, 3, 90)
    assert lo.tolist() == [[10] * 3] and hi.tolist() == [[40] * 3]
    raw[..., 20] = 0
    assert native._bool_row_intervals(m, 1, 90, spans=True) is None
    assert native._bool_row_intervals(torch.zeros(1, 1, 1, 90, dtype=torch.bool), 1, 90, spans=True) == (0, 0)
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(1, 2, 1, 8, generator=g) for _ in range(3))
    k, v = torch.randn(1, 2, 90, 8, generator=g), torch.randn(1, 2, 90, 8, generator=g)
    raw[..., 20] = 7
    with torch.no_grad():
        out = attnkit.attention(q, k, v, mask=m)
    ref, _ = golden(q, k, v, mask=m.clone())
    assert_close(out, ref, budget(torch.float32, 8, 90), "uint8 viewed as bool")


def test_bool_masks_of_other_ranks_or_values_in_one_decode_family_give_the_full_paths_answer(spy):
    """Review findings on the decode entry's bool masks: (1) masks of different ranks whose shapes agree but for S
    (``(1, S)`` then ``(1,)``; ``(S,)`` then a 0-d mask; ``(1, 1, 1, S)`` then ``(1, 1, 1)``) share no replayed
    call (they raised IndexError); (2) a signature first seen with a mask the decode entry refuses for its values
    (two stretches) still gives a later one-stretch mask the full path's answer, bit for bit (it stayed on the
    replayed SDPA call); (4) v shorter than k at the prepared S is the full path's error."""
    require_kernel()
    g = torch.Generator().manual_seed(16)

    def qkv(S):
        return (torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, S, 16, generator=g),
                torch.randn(1, 2, S, 16, generator=g))

    with torch.no_grad():
        for first, then in (((1, 37), (1,)), ((37,), ()), ((1, 1, 1, 37), (1, 1, 1))):
            _fast.clear()
            for shape, S in ((first, 37), (then, 38)):
                q, k, v = qkv(S)
                m = torch.ones(shape, dtype=torch.bool)
                out = attnkit.attention(q, k, v, mask=m)
                assert torch.equal(out, _full(q, k, v, mask=m)), (first, then, shape)
                assert_close(out, golden(q, k, v, mask=m)[0], budget(torch.float32, 16, S), f"{shape}")
        q, k, v = qkv(64)
        one = torch.zeros(1, 1, 1, 64, dtype=torch.bool)
        one[..., 8:40] = True
        two = torch.zeros(1, 1, 1, 64, dtype=torch.bool)
        two[..., :8] = True
        two[..., 40:] = True
        for masks_in_order in ((one, two, one), (two, one, two)):
            _fast.clear()
            for m in masks_in_order:
                out = attnkit.attention(q, k, v, mask=m)
                assert torch.equal(out, _full(q, k, v, mask=m))
        _fast.clear()
        q, k, v = qkv(40)
        m = torch.ones(1, 1, 1, 40, dtype=torch.bool)
        attnkit.attention(q, k, v, mask=m)
        with pytest.raises(ValueError, match=r"^v: "):
            attnkit.attention(q, k, v[:, :, :30], mask=m)
        with pytest.raises(ValueError, match=r"^v: "):
            _full(q, k, v[:, :, :30], mask=m)


def test_holds_data_finds_a_tensors_content_at_any_depth_of_a_key():
    """``_mods.holds_data`` (which decides whether a replayed signature is one of the few kept by content): True for a
    mod reading a tensor, however deep its content sits in the key (a closure of a closure, inside & | ~), False for
    code and numbers alone."""
    from attnkit import _mods

    ids = torch.tensor([0, 0, 1, 1])
    off = 3

    def outer():
        return lambda b, h, q, kv: ids[q] == ids[kv]

    inner = outer()
    cases = {
        "reads a tensor": (lambda b, h, q, kv: ids[q] == ids[kv], True),
        "a closure's closure reads it": (lambda b, h, q, kv: inner(b, h, q, kv) & (kv <= q), True),
        "numbers only": (lambda b, h, q, kv: kv <= q + off, False),
    }
    for what, (mod, want) in cases.items():
        key = masks.from_mod(mod).cache_key()
        assert key is not None, what
        assert _mods.holds_data(key) is want, what
        assert _mods.holds_data(("And", (("Not", key),), ("causal",))) is want, what
    assert _mods.holds_data(_mods.content_key(torch.ones(2))) is True
    assert _mods.holds_data(_mods.content_key(np.ones(2))) is True
    assert _mods.holds_data(None) is False and _mods.holds_data(()) is False


def test_a_table_that_wants_a_gradient_is_not_served_by_a_call_learned_with_a_frozen_one():
    """Two layers of the same score_mod code, one reading a frozen buffer and one a trainable table of the same
    values, and one table unfrozen between calls: the fast path must not replay the gradient-free call, and the
    table's gradient matches float64."""
    L = 64
    q, k, v = (torch.randn(1, 2, L, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def make(table):
        return lambda s, b, h, qi, kv: s + table[qi - kv + L]

    def want_grad(table):
        t = table.detach().double().requires_grad_()
        r = attnkit.attention(q.double(), k.double(), v.double(), score_mod=make(t), causal=True, backend="eager")
        return torch.autograd.grad((r ** 2).sum(), (t,))[0]

    frozen, learned = torch.zeros(2 * L), torch.nn.Parameter(torch.zeros(2 * L))
    for _ in range(2):
        attnkit.attention(q, k, v, score_mod=make(frozen), causal=True)
    out = attnkit.attention(q, k, v, score_mod=make(learned), causal=True)
    assert out.requires_grad
    (g,) = torch.autograd.grad((out ** 2).sum(), (learned,))
    assert_close(g, want_grad(learned), 1e-4, "the learned table's gradient")

    table = torch.randn(2 * L) * 0.1
    mod = make(table)
    for _ in range(2):
        assert not attnkit.attention(q, k, v, score_mod=mod, causal=True).requires_grad
    table.requires_grad_(True)
    out = attnkit.attention(q, k, v, score_mod=mod, causal=True)
    (g,) = torch.autograd.grad((out ** 2).sum(), (table,))
    assert_close(g, want_grad(table), 1e-4, "the unfrozen table's gradient")
