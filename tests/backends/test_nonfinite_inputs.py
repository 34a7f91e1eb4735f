"""NaN and inf in q, k or v, on every route ``auto`` takes at the shapes models run (decode, short prompts,
a bool mask of one tile, a window, a user's mask_mod, a soft cap), in fp32, bf16 and fp16.

What the answer is. A NaN or an inf reaches the rows whose scores it touches, and only them: NaN in q row i
makes row i NaN; an inf in key j makes NaN every row that *sees* key j with a +inf score (inf - inf in the
softmax); a -inf score is a weight of 0; a key the mask hides is never read, so its inf reaches no row. The
golden is the NumPy float64 reference (``backend="reference"``) on the same values (every input is a bf16
value, so each dtype holds the same numbers), compared as NaN patterns of the output and of lse (a NaN row's
lse is NaN on every backend).

Two faults these tests were written on (2026-11-28): torch's CPU flash kernel wrote an all-zero row where an
inf (not a NaN) in a key made the row NaN, and the check that re-runs such calls looked for NaN in the inputs
only (bf16 at L = S = 300 with a bool mask: 95 rows of zeros where the formula has NaN, silently); and with a
bool mask torch's kernel adds -inf to the scores of hidden keys, so an inf in a hidden key made its rows NaN
(fp32: 139 NaN rows where the formula has 95).

Gradients: where the calls of the two dtypes take different routes (fp32 with gradients on torch's SDPA, bf16
on attnkit's kernel or SDPA in fp32), bf16's gradients hold NaN exactly where fp32's do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.backends._tiles import has_nonfinite

# name: (B, H, Hkv, L, S, D, keyword arguments of attention); the mask is built per case
CASES = {
    "decode-128": (1, 8, 2, 1, 128, 64, {}),
    "decode-2048": (1, 8, 2, 1, 2048, 64, {}),
    "prefill-64-causal": (2, 4, 4, 64, 64, 16, {"causal": True}),
    "L200-causal-gqa": (1, 4, 2, 200, 200, 64, {"causal": True}),
    "L300-no-mask": (1, 2, 2, 300, 300, 32, {}),
    "bool-64": (1, 8, 8, 64, 64, 64, {"mask": "bool"}),
    "bool-300": (1, 2, 2, 300, 300, 32, {"mask": "bool"}),
    "window-512": (1, 2, 2, 512, 512, 32, {"mask": "window"}),
    "mask_mod-96": (1, 2, 1, 96, 96, 32, {"mask": "mod"}),
    "softcap-decode-256": (1, 4, 2, 1, 256, 32, {"causal": True, "score_mod": "cap"}),
}
WHERE = ["q", "k", "v"]
# Past a decode step (L > 16), where the compiled kernel runs a mask with partial tiles (the forward's 64 x 64
# tiles; not the decode entry, which reads each row's own keys) or torch's SDPA applies one, a value at a key the
# mask hides from a row is read at weight 0 if the key shares a tile with keys the row sees: 0 · NaN and 0 · inf
# are NaN in that value's column of the row, where the formula (the reference, the plain-op paths) has a number.
# Such a NaN is extra, never one missing.
TILE_READS = {"prefill-64-causal", "L200-causal-gqa", "mask_mod-96", "window-512", "bool-64", "bool-300"}
VALUES = [float("inf"), float("-inf"), float("nan")]


def _inputs(case, where, value):
    B, H, Hkv, L, S, D, kw = CASES[case]
    g = torch.Generator().manual_seed(7)
    # bf16 values, held in fp32: both dtypes see the same numbers
    q, k, v = (torch.randn(B, h, n, D, generator=g).bfloat16().float() for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    t = {"q": q, "k": k, "v": v}[where]
    t[0, 0, min(3, t.shape[2] - 1), 5] = value
    kw = dict(kw)
    if kw.get("mask") == "bool":
        kw["mask"] = torch.rand(L, S, generator=g) > 0.3
    elif kw.get("mask") == "window":
        i = torch.arange(L)[:, None]
        j = torch.arange(S)[None, :]
        kw["mask"] = (j <= i) & (j > i - 64)
    elif kw.get("mask") == "mod":
        kw["mask"] = masks.from_mod(lambda b, h, qi, ki: (ki <= qi) & ((qi - ki) % 3 != 1))
    if kw.get("score_mod") == "cap":
        kw["score_mod"] = lambda s, b, h, qi, ki: 20.0 * torch.tanh(s / 20.0)
    return q, k, v, kw


def _nan(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x)).isnan()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("value", VALUES, ids=["inf", "-inf", "nan"])
def test_forward_nan_where_the_formula_has_it(case, where, value):
    q, k, v, kw = _inputs(case, where, value)
    ref_out, ref_lse = attnkit.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                                         backend="reference", return_lse=True, **kw)
    ref_out = torch.as_tensor(ref_out)
    if value != value:  # (an inf may make no NaN: a soft cap's tanh(inf) = 1, a row whose scores are all -inf)
        assert ref_out.isnan().any(), "the case must make some row NaN"
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = [x.to(dtype) for x in (q, k, v)]
        tile_reads = where == "v" and case in TILE_READS
        for _ in range(2):  # the second call is the replayed one where the fast path replays this signature
            out = attnkit.attention(*a, **kw)
            why = (dtype, attnkit.dispatch(*a, **kw))
            if tile_reads:  # NaN wherever the formula has it (none hidden), inf where it has inf
                assert not (ref_out.isnan() & ~out.isnan()).any(), why
                assert torch.equal(out.isinf(), ref_out.isinf() & ~out.isnan()), why
                continue
            for f in (torch.isnan, torch.isposinf, torch.isneginf):
                assert torch.equal(f(out), f(ref_out)), (f.__name__, *why)
        out, lse = attnkit.attention(*a, return_lse=True, **kw)
        assert torch.equal(out.isnan(), ref_out.isnan()) or tile_reads, dtype
        assert torch.equal(lse.isnan(), _nan(ref_lse)), dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 8, 2, 1, 128, 64), (1, 8, 2, 1, 2048, 64), (2, 8, 2, 2, 64, 64),
                                   (2, 4, 2, 4, 1024, 64), (2, 8, 8, 16, 48, 32)],
                         ids=["decode-128", "decode-2048", "decode-2-over-64", "L4-S1024", "L16-S48"])
def test_garbage_in_cache_slots_the_mask_hides_never_reaches_a_decode_step(dtype, shape):
    """A KV cache allocated with ``torch.empty`` holds whatever was in memory (NaN, inf) in the slots past each
    sequence's length, which the padding mask hides: a decode step's output is that of the same step with zeros
    there (the decode entry reads each row's own keys; SDPA's route and the formula in plain ops never read a
    hidden value). Within the error budget of the dtype: the redo takes another path than the clean call."""
    B, H, Hkv, L, S, D = shape
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(dtype) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    lengths = torch.tensor([S - 37, S - 5][:B])
    keep = (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S) True = attend
    clean_k, clean_v = k.masked_fill(~keep.transpose(-1, -2), 0), v.masked_fill(~keep.transpose(-1, -2), 0)
    dirty_k, dirty_v = clean_k.clone(), clean_v.clone()
    for b, n in enumerate(lengths.tolist()):
        dirty_k[b, :, n::3] = float("nan")
        dirty_k[b, :, n + 1::3] = float("inf")
        dirty_v[b, :, n::2] = float("nan")
        dirty_v[b, :, n + 1::2] = -float("inf")
    want = attnkit.attention(q, clean_k, clean_v, mask=keep)
    assert torch.isfinite(want).all()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for _ in range(2):  # the second call replayed
        got = attnkit.attention(q, dirty_k, dirty_v, mask=keep)
        assert torch.isfinite(got).all(), attnkit.dispatch(q, dirty_k, dirty_v, mask=keep)
        assert (got.float() - want.float()).abs().max().item() <= tol


@pytest.mark.parametrize("case", ["decode-128", "decode-2048", "L300-no-mask", "bool-64", "bool-300"])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("value", VALUES, ids=["inf", "-inf", "nan"])
def test_bf16_gradients_nan_where_fp32_has_them(case, where, value):
    """At these shapes fp32 with gradients runs on torch's SDPA (the formula in plain ops once a NaN shows) and
    bf16 on attnkit's kernel (a bool mask too: its tile map) or SDPA in fp32: the same NaN in the output and the
    three gradients. Where fp32's SDPA reads a value the mask hides (TILE_READS, a non-finite value: 0 · inf in the
    rows that do not see it, and their gradients), bf16 on the kernel may be the formula's instead: its NaN are
    fp32's or fewer, its output's exactly the formula's. (fp16 with a bool mask runs on the tiled engine's plain
    worker, whose gradients also turn NaN at keys the mask hides from a NaN row: not held to fp32's here.)"""
    q, k, v, kw = _inputs(case, where, value)
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = attnkit.attention(*a, **kw)
        grads[dtype] = [out.isnan(), *torch.autograd.grad(out.float().sum(), a)]
    hidden_reads = where == "v" and case in TILE_READS
    for name, f, b in zip(["out", "dq", "dk", "dv"], grads[torch.float32], grads[torch.bfloat16], strict=True):
        if hidden_reads:
            assert not (b.isnan() & ~f.isnan()).any(), name
        else:
            assert torch.equal(f.isnan(), b.isnan()), name
    if hidden_reads:
        ref = attnkit.attention(*(x.detach().double().numpy() for x in (q, k, v)), backend="reference", **kw)
        assert torch.equal(grads[torch.bfloat16][0], _nan(ref)) or torch.equal(grads[torch.bfloat16][0],
                                                                               grads[torch.float32][0])


def test_a_finite_replayed_signature_then_an_inf_key():
    """A signature replayed with finite inputs, then the same call with an inf in a key the bool mask hides
    from some rows: the replay's check sends it to the full path, which gives the formula's NaN rows."""
    q, k, v, kw = _inputs("bool-300", "k", float("inf"))
    finite_k = k.clone()
    finite_k[0, 0, 3, 5] = 0.5
    for _ in range(3):
        attnkit.attention(q.bfloat16(), finite_k.bfloat16(), v.bfloat16(), **kw)
    ref = attnkit.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), backend="reference", **kw)
    out = attnkit.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw)
    assert torch.equal(out.isnan(), _nan(ref))
    assert not (out.float() == 0).all(-1).any(), "a row of zeros where the formula has NaN"


def test_has_nonfinite_sees_a_lone_inf():
    x = torch.zeros(4, 4)
    assert not has_nonfinite(x, x)
    for value in VALUES:
        y = x.clone()
        y[1, 2] = value
        assert has_nonfinite(x, y), value
        assert has_nonfinite(y.bfloat16()), value


@pytest.mark.parametrize("mask", ["causal", "bool"])
def test_formula_paths_never_read_a_hidden_value(mask):
    """The reference, eager and the tiled engine's plain worker (float64: no compiled kernel) on a NaN and an inf in
    V at keys hidden from some rows inside partial tiles: the same NaN / inf pattern, the rest equal within fp64's
    budget; eager and the plain worker's gradients NaN at the same places and finite for every query row that does
    not see those keys."""
    g = torch.Generator().manual_seed(5)
    L = S = 70
    q, k, v = (torch.randn(1, 4, L, 16, generator=g, dtype=torch.float64) for _ in range(3))
    k = k[:, :2].contiguous()
    v = v[:, :2].contiguous()
    v[0, 0, 40, 3] = float("nan")
    v[0, 1, 20, 7] = float("inf")
    kw = {"causal": True} if mask == "causal" else {"mask": torch.rand(L, S, generator=g) > 0.4}
    ref = torch.as_tensor(attnkit.attention(q.numpy(), k.numpy(), v.numpy(), backend="reference", **kw))
    assert ref.isnan().any() and ref.isinf().any()
    if mask == "causal":  # rows before the keys see a number
        assert torch.isfinite(ref[0, :, :20]).all() and torch.isfinite(ref[0, :2, :40]).all()
    grads = {}
    for backend in ("eager", "tiled"):
        a = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attnkit.attention(*a, backend=backend, **kw)
        for f in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(f(out), f(ref)), (backend, f.__name__)
        fin = torch.isfinite(ref)
        assert (out.detach()[fin] - ref[fin]).abs().max().item() < 1e-12, backend
        grads[backend] = torch.autograd.grad(out.masked_fill(~fin, 0).sum(), a)
    for ge, gt in zip(grads["eager"], grads["tiled"], strict=True):
        assert torch.equal(ge.isnan(), gt.isnan())
        fin = torch.isfinite(ge)
        assert torch.equal(fin, torch.isfinite(gt))
        assert torch.allclose(ge[fin], gt[fin], rtol=0, atol=1e-10)  # (dk may be NaN throughout: a row that sees
        # the NaN value has a NaN delta, so every key it sees gets NaN)
    if mask == "causal":  # query rows before key 20 see neither value: their gradients are finite
        assert torch.isfinite(grads["tiled"][0][0, :, :20]).all()


# A step of a few query rows whose rows see different keys, where a hidden key shares a 64-key tile with keys a row
# sees: the last key under a bottom-right causal mask (seen by the last row only); the first key of a window (by the
# first row only); a key between a sink and a window. (name, H, Hkv, L, S, D, mask)
FEW_ROWS = {
    "causal-L4-S4096": (8, 2, 4, 4096, 64, masks.causal()),
    "causal-L3-S200": (4, 4, 3, 200, 32, masks.causal()),
    "causal-L4-S2100-D20": (8, 2, 4, 2100, 20, masks.causal()),  # Dv not a multiple of the vector: V widened per tile
    "window-L2-S5000": (4, 2, 2, 5000, 32, masks.sliding_window(4500)),
    "sink-window-L5-S300": (4, 1, 5, 300, 16, masks.from_mod(lambda b, h, qi, kv: (kv < 4) | (kv > qi + 299 - 40))),
}


@pytest.mark.parametrize("case", list(FEW_ROWS))
@pytest.mark.parametrize("value", VALUES, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_few_rows_read_only_their_own_values(case, value, dtype):
    """The decode entry (no gradient) and the kernel's few-rows path (fp32 or bf16 with gradients) pack the rows of a
    kv head in one unit; a value at a key one row sees and another does not reaches only the row that sees it: the
    output's and the gradients' NaN / inf exactly where float64's formula has them, the rest within the dtype's
    budget (a hidden value times its weight 0 made every row of the unit NaN: 0 * NaN, 0 * inf)."""
    H, Hkv, L, S, D, mask = FEW_ROWS[case]
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, h, n, D, generator=g).to(dtype).float() for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    seen = mask.materialize(1, 1, L, S)[0, 0]
    j = int((seen[0] != seen[-1]).nonzero()[-1 if case.startswith("causal") else 0])  # one row sees it, not all
    if case.startswith("sink"):
        j = int((~seen[0, :60] & seen[0, :60].cumsum(0).bool()).nonzero()[0])  # hidden between sink and window
    v[0, 0, j, 5] = value
    go = torch.randn(1, H, L, D, generator=g)
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    want = attnkit.attention(*ref, mask=mask, backend="eager")
    want_g = torch.autograd.grad(want, ref, go.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for grad in (False, True):
        a = [x.to(dtype).requires_grad_(grad) for x in (q, k, v)]
        out = attnkit.attention(*a, mask=mask)
        d = attnkit.dispatch(*a, mask=mask)
        why = (case, grad, d.reason[:80])
        if not grad:  # the decode entry; with gradients, fp32 over 2048 keys or more: the kernel's few-rows path
            assert d.kernel.name == "native-decode", why
        elif dtype == torch.float32 and S >= 2048:
            assert d.kernel.name == "native", why
        pairs = [("out", out, want)]
        if grad:
            pairs += list(zip(("dq", "dk", "dv"), torch.autograd.grad(out, a, go.to(dtype)), want_g, strict=True))
        for name, x, w in pairs:
            x, w = x.detach().double(), w.detach()
            for f in (torch.isnan, torch.isposinf, torch.isneginf):
                assert torch.equal(f(x), f(w)), (name, f.__name__, *why)
            ok = torch.isfinite(w)
            assert (x[ok] - w[ok]).abs().max().item() <= tol * max(1.0, w[ok].abs().max().item()), (name, *why)



@pytest.mark.parametrize("L", [5, 17, 130])
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_inf_value_at_a_hidden_key_of_a_tile_map_reaches_no_row(dtype, D, L):
    """A sink and a window as a user's mask_mod (the kernel reads it as a tile map: its partial tiles' bits), L query
    rows over 300 keys, an inf in the value of a key between the sink and the window, which no row sees: no NaN in
    the output or the gradients, as in the float64 formula, which never reads a hidden value (the kernel's partial
    tiles multiplied every key's value by its weight, 0 where hidden: 0 * inf made every row of the tile NaN). bf16
    at D = 64: the AMX tiles where the CPU has them. The first call and its replays; with and without gradients."""
    S = 300
    mask = masks.from_mod(lambda b, h, qi, kv: (kv < 4) | (kv > qi + S - 1 - 40))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, n, D, generator=g).to(dtype) for h, n in ((4, L), (1, S), (1, S)))
    v[0, 0, 10, 5] = float("inf")
    go = torch.randn(1, 4, L, D, generator=g)
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    want = attnkit.attention(*ref, mask=mask, backend="eager")
    want_g = torch.autograd.grad(want, ref, go.double())
    assert not bool(want.isnan().any()) and not any(bool(x.isnan().any()) for x in want_g)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for grad in (False, True):
        a = [x.detach().requires_grad_(grad) for x in (q, k, v)]
        for _ in range(2):
            out = attnkit.attention(*a, mask=mask)
            pairs = [("out", out, want)]
            if grad:
                pairs += list(zip(("dq", "dk", "dv"), torch.autograd.grad(out, a, go.to(dtype)), want_g, strict=True))
            for name, x, w in pairs:
                x, w = x.detach().double(), w.detach()
                assert not bool(x.isnan().any()), (name, grad, int(x.isnan().any(-1).sum()))
                assert (x - w).abs().max().item() <= tol * max(1.0, w.abs().max().item()), (name, grad)
