"""backend="auto" picks the backend the measurements say (see attnkit._dispatch), and that
backend is the one that actually runs."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, budget, golden, rand_qkv, require_kernel

import attnkit
from attnkit import _fast
from attnkit import masks as M
from attnkit import score_mods as SM
from attnkit.backends import _native, _table


@pytest.fixture
def ran(monkeypatch):
    """Records the backend of each declared kernel that ran (the fast path counts as sdpa's)."""
    calls = []
    for row in _table.TABLES["cpu"]:
        kern = row.kernel

        def spy(req, _orig=kern.run, _name=kern.backend):
            calls.append(_name)
            return _orig(req)

        monkeypatch.setattr(kern, "run", spy)
    real_fast = _fast.attention

    def fast_spy(q, k, v, mask, causal, scale, score_mod=None):  # a replayed decision (attnkit._fast): auto's
        out = real_fast(q, k, v, mask, causal, scale, score_mod)
        if out is not None:
            calls.append(attnkit.dispatch(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod).backend)
        return out

    monkeypatch.setattr(_fast, "attention", fast_spy)
    return calls


L = 128
WINDOW_DENSE = M.sliding_window(16).materialize(1, 1, L, L)

CASES = [
    ("dense", {}, "sdpa"),
    # causal at L = 128: past the defaults' crossover (64), on the compiled kernel where it is built
    ("causal L==S", {"causal": True}, "tiled" if _native.available() else "sdpa"),
    ("causal top-left", {"mask": M.causal("top_left")}, "tiled" if _native.available() else "sdpa"),
    ("float bias only", {"mask": torch.randn(1, 1, L, L)}, "sdpa"),
    ("random bool mask: every tile partial", {"mask": torch.rand(1, 1, L, L) > 0.5}, "sdpa"),
    ("banded bool mask: tiles to skip", {"mask": WINDOW_DENSE}, "tiled"),
    ("sliding window", {"mask": M.sliding_window(16)}, "tiled"),
    ("document", {"mask": M.document(torch.arange(L) // 40)}, "tiled"),
    ("prefix-LM", {"mask": M.prefix_lm(10)}, "tiled"),
    ("from_mod", {"mask": lambda b, h, q, kv: kv <= q}, "tiled"),
    ("causal + bias", {"causal": True, "mask": torch.randn(1, 1, L, L)}, "tiled"),
    ("score_mod", {"score_mod": SM.softcap(5.0)}, "tiled"),
    ("alibi + causal", {"score_mod": SM.alibi(torch.rand(4)), "causal": True}, "tiled"),
    ("dropout", {"dropout_p": 0.1}, "eager"),
]


@pytest.mark.parametrize("name,kw,want", CASES, ids=[c[0] for c in CASES])
def test_auto_choice(ran, name, kw, want):
    q, k, v = rand_qkv(1, 4, 4, L, L, 16)
    d = attnkit.dispatch(q, k, v, **kw)
    assert d.backend == want, f"{name}: {d}"
    assert d.reason
    attnkit.attention(q, k, v, **kw)
    assert ran == [want]


@pytest.mark.parametrize("L", [17, 63])  # (16 rows and fewer: a decode step, the decode entry)
def test_causal_below_the_defaults_crossover_stays_on_sdpa(ran, L):
    """Without a calibration (the suite's ATTNKIT_CALIBRATION=off) causal runs on torch's kernel below
    min(L, S) = 64, where its lower per-call cost wins, and on the compiled kernel from there (CASES above)."""
    q, k, v = rand_qkv(1, 4, 4, L, L, 16)
    d = attnkit.dispatch(q, k, v, causal=True)
    assert d.backend == "sdpa" and "table: defaults" in d.reason, d
    attnkit.attention(q, k, v, causal=True)
    assert ran == ["sdpa"]


def test_decode_sized_structured_mask_goes_to_the_decode_entry_or_sdpa_over_reachable_keys(ran):
    """A decode step with a built-in mask: the compiled kernel's decode entry (inference; the mask as row
    intervals); with a gradient wanted (or without the kernel), SDPA over the keys the mask can reach."""
    from attnkit.backends import _native, sdpa
    for grad in (False, True):
        q, k, v = rand_qkv(1, 4, 2, 3, 300, 8, requires_grad=grad)
        for kw in (dict(causal=True), dict(mask=M.sliding_window(50)), dict(mask=M.document(torch.arange(300) // 90))):
            ran.clear()
            d = attnkit.dispatch(q, k, v, **kw)
            if _native.available() and not grad:
                assert (d.backend, d.worker) == ("tiled", "native") and "decode" in d.reason, d
            else:
                assert d.backend == "sdpa" and "decode-sized" in d.reason, d
            out = attnkit.attention(q, k, v, **kw)
            assert ran == [d.backend]
            ref = attnkit.attention(*(t.detach().double() for t in (q, k, v)), backend="reference", **kw)
            assert torch.allclose(out.detach().double(), ref, atol=1e-5), kw
    req = attnkit._request.make_request(q, k, v, mask=M.sliding_window(50), causal=False, scale=None, score_mod=None,
                                        dropout_p=0.0, return_lse=False, backend="auto")
    assert sdpa.key_range(req) == (248, 300)  # only the window's keys reach SDPA: 300 - 3 - 50 + 1 = 248


def test_bottom_right_causal_l_ne_s_goes_tiled(ran):
    q, k, v = rand_qkv(1, 2, 2, 40, 90, 8)
    assert attnkit.dispatch(q, k, v, causal=True).backend == "tiled"
    out = attnkit.attention(q, k, v, causal=True)
    assert ran == ["tiled"]
    ref = attnkit.attention(q, k, v, causal=True, backend="reference")
    assert torch.allclose(out, ref, atol=1e-5)


def test_lse_with_grad_goes_tiled(ran):
    q, k, v = rand_qkv(1, 2, 2, 16, 16, 8, requires_grad=True)
    assert attnkit.dispatch(q, k, v, return_lse=True).backend == "tiled"


@pytest.mark.parametrize("backend, kw, auto_runs", [
    ("sdpa", {"score_mod": SM.softcap(2.0)}, "tiled"),
    ("tiled", {"dropout_p": 0.5}, "eager"),
], ids=["sdpa+score_mod", "tiled+dropout"])
def test_named_backend_raises_where_auto_would_switch(ran, backend, kw, auto_runs):
    """What auto answers by switching backend, a named backend refuses: it raises before any
    backend runs (no silent fallback), while auto runs the other backend."""
    q, k, v = rand_qkv(1, 2, 2, 8, 8, 4)
    with pytest.raises(ValueError, match=f"backend={backend!r} cannot honour"):
        attnkit.attention(q, k, v, backend=backend, **kw)
    with pytest.raises(ValueError, match=f"backend={backend!r} cannot honour"):
        attnkit.dispatch(q, k, v, backend=backend, **kw)
    assert ran == []
    assert attnkit.dispatch(q, k, v, **kw).backend == auto_runs
    attnkit.attention(q, k, v, **kw)
    assert ran == [auto_runs]


@pytest.mark.parametrize("L, S, kw", [(128, 128, {}), (16, 1024, dict(mask=M.sliding_window(64))), (1, 128, {}),
                                      (64, 64, {}), (3, 40, dict(score_mod=SM.softcap(5.0)))])
def test_bf16_with_gradients_goes_to_the_kernel_where_the_cpu_has_no_bf16_instructions(monkeypatch, ran, L, S, kw):
    """Where SDPA would take a bf16 call, one that wants gradients goes to the compiled kernel on a CPU without bf16
    instructions (torch's bf16 backward there: 4-5x its fp32 time) at every size, a decode step's too (its replays
    run the kernel's forward and backward prepared once); with bf16 instructions SDPA keeps it. The answer of the
    first call and of its replays is the kernel's, bit for bit: output and gradients. (No mask below the fp32
    crossover, and a decode-sized call with a mask: SDPA's ground.)"""
    require_kernel()
    from attnkit.backends import native

    q, k, v = rand_qkv(1, 4, 4, L, S, 32, dtype=torch.bfloat16, requires_grad=True)
    monkeypatch.setattr(native, "_BF16_HW", False)
    d = attnkit.dispatch(q, k, v, **kw)
    assert d.worker == "native" and ("bfloat16 with gradients" in d.reason or "score_mod" in d.reason), d
    ref = attnkit.attention(q, k, v, backend="tiled", **kw)
    gref = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    for _ in range(3):  # the first call, then its replays
        out = attnkit.attention(q, k, v, **kw)
        assert ran[-1] == "tiled"
        g = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(g, gref, strict=True))
        assert all(x.dtype == torch.bfloat16 for x in g)
    # SDPA keeps: a CPU with bf16 instructions, or fp32
    monkeypatch.setattr(native, "_BF16_HW", True)
    monkeypatch.setattr(native._native, "bf16_dot", lambda: False)  # (and a kernel that widens bf16: no AMX)
    if "score_mod" not in kw:
        assert attnkit.dispatch(q, k, v, **kw).worker == "fused"
        monkeypatch.setattr(native, "_BF16_HW", False)
        assert attnkit.dispatch(q.float(), k.float(), v.float(), **kw).worker == "fused"


def test_a_measured_bf16_gradient_choice_holds_where_bf16s_forward_stays_on_torch(monkeypatch):
    """A table with bf16's forward on torch's kernel and bf16 with gradients on the compiled kernel (measured apart:
    an AMX machine may measure just that): a call that wants gradients runs on the kernel, one without stays on
    torch's — the kernel's own dtype rule steps aside for the measured gradient choice."""
    require_kernel()
    from attnkit import _calibrate

    table = _calibrate.Crossovers(bf16="torch", bf16_grad="kernel", source="calibrated 2026-11-27 on X")
    monkeypatch.setattr(_calibrate, "crossovers", lambda threads=None: table)
    q, k, v = rand_qkv(1, 4, 4, 128, 128, 32, dtype=torch.bfloat16, requires_grad=True)
    d = attnkit.dispatch(q, k, v)
    assert d.worker == "native" and "measured faster" in d.reason, d
    assert attnkit.dispatch(q.detach(), k.detach(), v.detach()).worker == "fused"
    assert attnkit.dispatch(q, k, v, mask=M.sliding_window(16)).worker == "native"  # a mask: the kernel, as measured


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L, kw", [(128, {}), (96, dict(causal=True)), (40, {})], ids=["none", "causal", "short"])
def test_low_precision_below_the_fp32_crossovers_goes_to_the_kernel(monkeypatch, ran, dtype, L, kw):
    """A bf16 / fp16 call without gradients that SDPA would take on size grounds (no mask below the fp32 crossover,
    causal below it) runs on the compiled kernel where the CPU has no bf16 instructions (torch's kernels convert
    through fp32 there: 1.2-3x their fp32 time at L = S = 64) or where the calibration measured it so; the answer is
    the kernel's, bit for bit, on the first call and its replays. SDPA keeps: a CPU with bf16 instructions, a
    measured "torch", fp32, a float bias."""
    require_kernel()
    from attnkit import _calibrate
    from attnkit.backends import native

    monkeypatch.setattr(native, "_BF16_HW", False)
    monkeypatch.setattr(_calibrate, "crossovers", lambda threads=None: _calibrate.Crossovers(native_causal_min=1024))
    q, k, v = rand_qkv(1, 4, 2, L, L, 32, dtype=dtype)
    d = attnkit.dispatch(q, k, v, **kw)
    assert d.worker == "native" and "without bf16 instructions" in d.reason, d
    outs = [attnkit.attention(q, k, v, **kw) for _ in range(3)]
    assert ran[-3:] == ["tiled"] * 3
    ref = attnkit.attention(q, k, v, backend="tiled", **kw)
    assert all(o.dtype == dtype and torch.equal(o, ref) for o in outs)
    assert attnkit.dispatch(q.float(), k.float(), v.float(), **kw).worker == "fused"
    bias = torch.zeros(L, L, dtype=dtype)
    assert attnkit.dispatch(q, k, v, mask=bias).worker == "fused"
    monkeypatch.setattr(native, "_BF16_HW", True)
    monkeypatch.setattr(native._native, "bf16_dot", lambda: False)  # (and a kernel that widens bf16: no AMX)
    assert attnkit.dispatch(q, k, v, **kw).worker == "fused"
    monkeypatch.setattr(native, "_BF16_HW", False)
    choice = {"bf16_small" if dtype == torch.bfloat16 else "fp16_small": "torch"}
    table = _calibrate.Crossovers(native_causal_min=1024, source="calibrated 2026-11-27 on X", **choice)
    monkeypatch.setattr(_calibrate, "crossovers", lambda threads=None: table)
    assert attnkit.dispatch(q, k, v, **kw).worker == "fused"


def _widened_reference(q, k, v, go, **kw):
    """auto's fp32 call (torch SDPA, with its grouped-query fold) on fp32 copies, rounded back, gradients through
    the casts: what the sdpa-fp32 row runs."""
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    assert attnkit.dispatch(q32, k32, v32, **kw).kernel.name == "sdpa"
    out = attnkit.attention(q32, k32, v32, **kw).to(torch.bfloat16)
    return out, [g.to(torch.bfloat16) for g in torch.autograd.grad(out, (q32, k32, v32), go)]


@pytest.mark.parametrize("case", ["decode", "bool64", "decode_window"])
def test_bf16_with_gradients_where_sdpa_keeps_it_runs_sdpa_in_fp32_on_widened_copies(monkeypatch, case):
    """A bf16 call that wants gradients, which SDPA keeps and the compiled kernel does not run (switched off, or not
    built: a bool mask of a decode step, of one tile) runs torch SDPA in fp32 on fp32 copies with the output rounded
    back (the sdpa-fp32 row) on a CPU without bf16 instructions: the same bits as doing that by hand — output and
    bf16 gradients — on the first call and its replays, and within bf16's budget of the float64 golden. SDPA's bf16
    kernel keeps it with bf16 instructions, without gradients, and for a named backend="sdpa". With the kernel on,
    the kernel takes these calls (a bool mask's tile map: tests/backends/test_native_bool_mask.py)."""
    from attnkit.backends import native, tiled

    monkeypatch.setattr(native, "_BF16_HW", False)
    g = torch.Generator().manual_seed(3)
    if case == "bool64":
        L, S, H, Hkv = 64, 64, 4, 4
        mask = torch.rand(L, S, generator=g) < 0.6
        mask[5] = False  # a row that sees nothing: out 0, gradients 0
        kw = dict(mask=mask)
    else:  # a decode step's padding, and a window of it, as bool tensors
        L, S, H, Hkv = 1, 512, 8, 2
        keep = torch.arange(S) >= 7
        kw = dict(mask=keep if case == "decode" else keep & (torch.arange(S) > 211))
    q, k, v = rand_qkv(1, H, Hkv, L, S, 32, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(1, H, L, 32, generator=g).to(torch.bfloat16)
    if native._native.available():
        assert attnkit.dispatch(q, k, v, **kw).kernel.name == "native"
    monkeypatch.setattr(tiled, "NATIVE", False)
    d = attnkit.dispatch(q, k, v, **kw)
    assert d.kernel is not None and d.kernel.name == "sdpa-fp32" and "widened copies" in d.reason, d
    ref, gref = _widened_reference(q, k, v, go, **kw)
    for _ in range(3):  # the first call, then its replays
        out = attnkit.attention(q, k, v, **kw)
        grads = torch.autograd.grad(out, (q, k, v), go)
        assert out.dtype == torch.bfloat16 and all(x.dtype == torch.bfloat16 for x in grads)
        assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, gref, strict=True)), case
    gold, _ = golden(q, k, v, **kw)
    assert_close(out, gold, 2.0 ** -8 * gold.abs().max().item() + budget(torch.float32, 32, S), case)
    if case == "bool64":
        assert bool((out[0, :, 5] == 0).all()) and bool((grads[0][0, :, 5] == 0).all())
    for q2, k2, v2 in ((q.detach(), k.detach(), v.detach()), (q.float(), k.float(), v.float())):
        assert attnkit.dispatch(q2, k2, v2, **kw).kernel.name != "sdpa-fp32"
    assert attnkit.dispatch(q, k, v, backend="sdpa", **kw).kernel.name == "sdpa"
    if case == "decode":  # fewer than WIDEN_MIN_SCORES scores (8 heads over 128 keys): the casts would cost more
        assert attnkit.dispatch(q, k[:, :, :128], v[:, :, :128], mask=keep[:128]).kernel.name == "sdpa"
        assert attnkit.dispatch(q, k, v, mask=M.padding(torch.tensor([505]))).kernel.name == "sdpa-fp32"
    monkeypatch.setattr(native, "_BF16_HW", True)
    monkeypatch.setattr(native._native, "bf16_dot", lambda: False)  # (and a kernel that widens bf16: no AMX)
    assert attnkit.dispatch(q, k, v, **kw).kernel.name == "sdpa"


def test_bf16_grads_at_a_few_rows_go_to_the_kernel_at_every_size(monkeypatch):
    """bf16 with gradients at a few query rows (the kernel's few-rows backward: row intervals, no score_mod program;
    or its key-tile backward for a tile map) runs the compiled kernel on a CPU without bf16 instructions, over 2048
    keys and over 64 — its output the kernel's own bits, its gradients within bf16's budget of float64 — and SDPA's
    with bf16 instructions."""
    from attnkit.backends import native

    monkeypatch.setattr(native, "_BF16_HW", False)
    q, k, v = rand_qkv(1, 8, 2, 1, 2048, 32, dtype=torch.bfloat16, requires_grad=True)
    for kw in ({"causal": True}, {"mask": M.sliding_window(700)}):
        d = attnkit.dispatch(q, k, v, **kw)
        assert d.kernel.name == "native", (kw, d)
        out = attnkit.attention(q, k, v, **kw)
        assert torch.equal(out, attnkit.attention(q, k, v, backend="tiled", **kw))
        go = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), go)
        q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
        want = torch.autograd.grad(attnkit.attention(q2, k2, v2, backend="eager", **kw), (q2, k2, v2), go.double())
        for name, a, b in zip("qkv", grads, want, strict=True):
            assert a.dtype == torch.bfloat16
            assert_close(a, b, 2.0 ** -6 * max(1.0, b.abs().max().item()), f"{kw} d{name}")
    short = k[:, :, :64].detach().requires_grad_(), v[:, :, :64].detach().requires_grad_()
    assert attnkit.dispatch(q, *short, causal=True).kernel.name == "native"  # 512 scores
    tile_map = {"mask": lambda b, h, qi, kv: (kv % 3) != 0}  # rows of many stretches: the key-tile backward
    assert attnkit.dispatch(q, k, v, **tile_map).kernel.name == "native"
    monkeypatch.setattr(native, "_BF16_HW", True)
    monkeypatch.setattr(native._native, "bf16_dot", lambda: False)  # (and a kernel that widens bf16: no AMX)
    assert attnkit.dispatch(q, k, v, causal=True).kernel.name == "sdpa"


def test_fp32_grads_at_a_few_rows_over_a_long_cache_go_to_the_kernel(monkeypatch):
    """fp32 with gradients at a few query rows whose rows reach FEW_ROWS_GRAD_MIN_KEYS keys or more runs the compiled
    kernel (its decode-entry forward and few-rows backward) — the kernel's own bits, gradients within fp32's budget
    of float64 — and stays on SDPA below that span (fewer keys, a window's reach), with a float bias, past
    DECODE_MAX_L rows, without gradients (the decode entry), and where this machine's table measured SDPA faster."""
    require_kernel()
    from attnkit import _calibrate
    from attnkit.backends import sdpa

    n = sdpa.FEW_ROWS_GRAD_MIN_KEYS
    q, k, v = rand_qkv(1, 8, 2, 3, n + 37, 32, requires_grad=True)
    for kw in ({"causal": True}, {"mask": M.sliding_window(n + 5)}, {"mask": lambda b, h, i, j: j <= i + n + 34}):
        d = attnkit.dispatch(q, k, v, **kw)
        assert d.kernel.name == "native" and "few query rows with gradients" in d.reason, (kw, d)
        out = attnkit.attention(q, k, v, **kw)
        assert torch.equal(out, attnkit.attention(q, k, v, backend="tiled", **kw))
        go = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), go)
        q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = attnkit.attention(q2, k2, v2, backend="eager", **kw)
        assert_close(out, ref, budget(torch.float32, 32, n + 37), f"{kw} out")
        want = torch.autograd.grad(ref, (q2, k2, v2), go.double())
        for name, a, b in zip("qkv", grads, want, strict=True):
            assert_close(a, b, budget(torch.float32, 32, n + 37) * max(1.0, b.abs().max().item()), f"{kw} d{name}")
    short = (k[:, :, :n - 1].detach().requires_grad_(), v[:, :, :n - 1].detach().requires_grad_())
    assert attnkit.dispatch(q, *short, causal=True).kernel.name == "sdpa"
    assert attnkit.dispatch(q, k, v, mask=M.sliding_window(256)).kernel.name == "sdpa"  # its rows reach 258 keys
    # the span of the rows that see a key: a fully padded batch row (stored as the interval (0, 0)) does not stretch
    # it to key 0
    valid = torch.zeros(2, n + 37, dtype=torch.bool)
    valid[1, -300:] = True
    q2, k2, v2 = (torch.cat([t.detach()] * 2).requires_grad_() for t in (q, k, v))
    assert attnkit.dispatch(q2, k2, v2, mask=M.key_padding(valid)).kernel.name == "sdpa"
    valid[0, :n] = True
    assert attnkit.dispatch(q2, k2, v2, mask=M.key_padding(valid)).kernel.name == "native"
    assert "few query rows" not in attnkit.dispatch(q, k, v, mask=torch.randn(1, 1, 3, n + 37)).reason
    assert attnkit.dispatch(q.detach(), k.detach(), v.detach(), causal=True).kernel.name == "native-decode"
    q17 = torch.randn(1, 8, sdpa.DECODE_MAX_L + 1, 32, requires_grad=True)
    assert "few query rows" not in attnkit.dispatch(q17, k, v, causal=True).reason
    monkeypatch.setattr(_calibrate, "crossovers", lambda threads=None: _calibrate.Crossovers(few_rows_grad="torch"))
    assert attnkit.dispatch(q, k, v, causal=True).kernel.name == "sdpa"


def test_widened_sdpa_keeps_nan_where_fp32_has_it(monkeypatch):
    """NaN in a bf16 query row on the compiled kernel's route (no mask, a bool mask tensor: the first call and its
    replays, on the kernel's forward and backward prepared once) and, the kernel switched off, on the sdpa-fp32 row
    (the bool mask): NaN on that row's output and on the gradients it reaches, as fp32."""
    from attnkit.backends import native, tiled

    monkeypatch.setattr(native, "_BF16_HW", False)
    q, k, v = rand_qkv(1, 8, 2, 1, 512, 32, dtype=torch.bfloat16)
    q[0, 3, 0, 0] = float("nan")
    q.requires_grad_()
    keep = torch.arange(512) >= 3
    for kw, name in ((dict(mask=keep), "native"), ({}, "native"), (dict(mask=keep), "sdpa-fp32")):
        if name == "native" and not native._native.available():
            continue
        monkeypatch.setattr(tiled, "NATIVE", name == "native")
        assert attnkit.dispatch(q, k, v, **kw).kernel.name == name
        q32 = q.detach().float().requires_grad_()
        ref = attnkit.attention(q32, k.float(), v.float(), **kw)
        (gref,) = torch.autograd.grad(ref.sum(), q32)
        for _ in range(3):
            out = attnkit.attention(q, k, v, **kw)
            assert torch.equal(out.isnan(), ref.isnan()) and bool(out[0, 3].isnan().all()), name
            (g,) = torch.autograd.grad(out.sum(), q)
            assert torch.equal(g.isnan(), gref.isnan()) and bool(g[0, 3].isnan().all()), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_stays_on_torch_only_where_torch_runs_the_call_whole(monkeypatch, dtype, widened_bf16):
    """On a CPU that multiplies bf16 in hardware the default table keeps bf16 on torch's kernel for a call it runs
    as one fused kernel (no mask, causal); a structured mask or a score_mod would make it torch's kernel per run of
    tiles or plain torch ops per tile, slower in bf16 than the compiled kernel's fp32 math, so the kernel takes
    those, and answers as for fp32 inputs widened. fp16 follows its own (measured) rule: the kernel."""
    require_kernel()
    from attnkit.backends import native

    monkeypatch.setattr(native, "_BF16_HW", True)
    monkeypatch.setattr(native._native, "bf16_dot", lambda: False)  # (and a kernel that widens bf16: no AMX)
    q, k, v = rand_qkv(1, 4, 2, 256, 256, 32, dtype=dtype)
    with torch.no_grad():
        causal = attnkit.dispatch(q, k, v, causal=True)
        assert (causal.worker == "native") is (dtype == torch.float16), causal
        for kw in (dict(mask=M.sliding_window(32)), dict(causal=True, score_mod=SM.softcap(5.0)),
                   dict(mask=M.causal() & M.from_mod(lambda b, h, i, j: j % 3 != 1))):
            d = attnkit.dispatch(q, k, v, **kw)
            assert d.worker == "native", (kw, d)
            out = attnkit.attention(q, k, v, **kw)
            want = attnkit.attention(q.float(), k.float(), v.float(), **kw).to(dtype)
            assert out.dtype is dtype and torch.equal(out, want), kw


def test_where_the_kernel_multiplies_bf16_on_amx_bf16_with_gradients_leaves_torchs_bf16_kernels(monkeypatch):
    """A CPU with AMX whose bf16 the kernel multiplies on tiles: torch's bf16 backward there measured 2.4x its fp32
    one at L = S = 64 and 2.4x the kernel's at 256 (Intel Xeon), so by default a bf16 call with gradients goes to the
    kernel at every size (a decode step's too), and where the kernel does not run it (a tensor mask SDPA keeps) SDPA
    runs in fp32 on widened copies (the kernel switched off; with it, a bool mask is its tile map); a calibration
    that measured torch's bf16 backward faster keeps it on torch's."""
    require_kernel()
    from attnkit import _calibrate
    from attnkit.backends import native, tiled

    monkeypatch.setattr(native, "_BF16_HW", True)
    monkeypatch.setattr(native._native, "bf16_dot", lambda: True)
    q, k, v = rand_qkv(1, 4, 4, 128, 128, 32, dtype=torch.bfloat16, requires_grad=True)
    d = attnkit.dispatch(q, k, v)
    assert d.worker == "native" and "AMX" in d.reason, d
    qd, kd, vd = rand_qkv(1, 8, 2, 1, 512, 32, dtype=torch.bfloat16, requires_grad=True)
    keep = torch.arange(512) >= 3
    assert attnkit.dispatch(qd, kd, vd).kernel.name == "native"
    assert attnkit.dispatch(qd, kd, vd, mask=keep).kernel.name == "native"  # (a bool mask: its tile map)
    monkeypatch.setattr(tiled, "NATIVE", False)
    assert attnkit.dispatch(qd, kd, vd, mask=keep).kernel.name == "sdpa-fp32"
    monkeypatch.setattr(tiled, "NATIVE", True)
    table = _calibrate.Crossovers(bf16_grad="torch", source="calibrated 2026-11-29 on X")
    monkeypatch.setattr(_calibrate, "crossovers", lambda threads=None: table)
    assert attnkit.dispatch(q, k, v).worker == "fused"
    assert attnkit.dispatch(qd, kd, vd).kernel.name == "sdpa"
    assert attnkit.dispatch(qd, kd, vd, mask=keep).kernel.name == "sdpa"
