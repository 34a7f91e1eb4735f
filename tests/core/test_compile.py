"""attnkit.attention under torch.compile(fullgraph=True) and torch.export (attnkit._op, issue 26 item 2).

``fullgraph=True`` compiling at all is the "0 graph breaks" check (TorchDynamo raises on any break). Compiles
use the ``aot_eager`` backend (AOT autograd, the fake implementations and the op's autograd formula, without
inductor's C++ build: seconds, not minutes); ``benchmarks/compile_step.py`` runs inductor. Shapes are tiny.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, budget, rand_qkv, require_kernel

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

B, H, L, D = 2, 2, 80, 16
IDS = torch.tensor([0] * 30 + [1] * 25 + [2] * 25)
TABLE = torch.nn.Parameter(torch.randn(H, 2 * L - 1) * 0.5)  # a learnable relative-position bias


def _make_rel(table):
    def rel(score, b, h, q_idx, kv_idx):  # the tensor is captured in the closure
        return score + table[h, q_idx - kv_idx + L - 1]

    return rel


REL = _make_rel(TABLE)


def _band(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 20


def _softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


CALLS = {
    "causal": dict(causal=True),
    "sliding_window": dict(mask=M.sliding_window(24)),
    "document": dict(mask=M.document(IDS)),
    "mask_mod": dict(mask=_band),
    "score_mod": dict(causal=True, score_mod=REL),
    "softcap_document": dict(mask=M.document(IDS) & M.causal(), score_mod=_softcap),
    "builtin_score_mods": dict(mask=M.causal(), score_mod=SM.relative_bias(TABLE[:, L - 20:L + 19])),
}


def _grads(fn, q, k, v, leaves):
    out = fn(q, k, v)
    go = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
    return out, torch.autograd.grad((out * go).sum(), (q, k, v, *leaves))


@pytest.mark.parametrize("name", list(CALLS))
def test_fullgraph_forward_backward_equal_eager_and_float64(name):
    """0 graph breaks (fullgraph=True), and out, dq, dk, dv and a learnable table's gradient match eager and the
    float64 autograd reference within the error budget."""
    kw = CALLS[name]
    q, k, v = rand_qkv(B, H, H, L, L, D, requires_grad=True)
    fn = lambda q, k, v: attnkit.attention(q, k, v, **kw)  # noqa: E731
    leaves = [TABLE] if "score_mod" in name or "builtin" in name else []
    cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, got = _grads(cf, q, k, v, leaves)
    eout, eager = _grads(fn, q, k, v, leaves)
    tol = budget(torch.float32, D, L)
    assert_close(out, eout, tol, f"{name}: out vs eager")
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    kw64 = dict(kw)
    if "score_mod" in name:  # the same mod over a float64 copy of the table (the table's grad compared below)
        t64 = TABLE.detach().double().requires_grad_()
        kw64["score_mod"] = _make_rel(t64) if kw["score_mod"] is REL else kw["score_mod"]
        leaves64 = [t64] if kw["score_mod"] is REL else [TABLE]
    else:
        leaves64 = leaves
    ref = attnkit.attention(qd, kd, vd, backend="eager", **kw64)
    go = torch.linspace(-1, 1, ref.numel(), dtype=torch.float64).reshape(ref.shape)
    want = torch.autograd.grad((ref * go).sum(), (qd, kd, vd, *leaves64))
    assert_close(out, ref, tol, f"{name}: out vs float64")
    for what, a, e, w in zip(["dq", "dk", "dv", "dtable"], got, eager, want, strict=False):
        scale = max(1.0, w.abs().max().item())
        assert_close(a, w, 4 * tol * scale, f"{name}: {what} vs float64")
        assert_close(a, e, 4 * tol * scale, f"{name}: {what} vs eager")


def test_explain_counts_no_graph_break_and_one_op_call():
    """torch._dynamo.explain over a model-like function with several calls: one graph, 0 breaks, and the graph
    calls attnkit's op (not a Python fallback)."""
    q, k, v = rand_qkv(1, H, H, L, L, D)

    def f(q, k, v):
        x = attnkit.attention(q, k, v, causal=True)
        x = attnkit.attention(x, k, v, mask=M.sliding_window(24), score_mod=REL)
        return attnkit.attention(x, k, v, mask=_band)

    e = torch._dynamo.explain(f)(q, k, v)
    assert e.graph_count == 1 and e.graph_break_count == 0, e.break_reasons
    code = e.graphs[0].code
    assert code.count("torch.ops.attnkit.attention") == 3, code


def test_captured_tensor_edited_in_place_after_compiling_is_never_stale():
    """The document ids a mask_mod captures and the table a score_mod captures are op inputs: editing them in
    place after compiling changes the compiled result exactly as it changes the eager one."""
    ids = IDS.clone()
    table = torch.zeros(H, 2 * L - 1)

    def mask_mod(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    sm = _make_rel(table)
    fn = lambda q, k, v: attnkit.attention(q, k, v, mask=mask_mod, score_mod=sm)  # noqa: E731
    cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
    q, k, v = rand_qkv(1, H, H, L, L, D)
    before = cf(q, k, v)
    assert_close(before, fn(q, k, v), 0.0, "before the edit")
    ids[10:30] = 1
    table[:, L - 1] = 3.0
    after = cf(q, k, v)
    assert (after - before).abs().max() > 0.1  # the edit changed the answer ...
    assert_close(after, fn(q, k, v), 0.0, "after the edit")  # ... to the eager one


def test_another_window_or_function_constant_recompiles():
    """What the key is made of (a window size, a constant a mask_mod closes over) is guarded: a new value
    gives a new graph and the right answer, never the first graph's."""
    q, k, v = rand_qkv(1, H, H, L, L, D)

    def make_band(w):
        return lambda b, h, qi, ki: (qi - ki).abs() <= w

    fn = lambda q, k, v, m: attnkit.attention(q, k, v, mask=m)  # noqa: E731
    cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for m in (M.sliding_window(8), M.sliding_window(30), make_band(3), make_band(9)):
        assert_close(cf(q, k, v, m), fn(q, k, v, m), 0.0, repr(m))


def test_a_function_made_inside_the_compiled_code_with_constants():
    """A mask_mod / score_mod defined inside the compiled function (capturing constants) is described too."""
    q, k, v = rand_qkv(1, H, H, L, L, D, requires_grad=True)

    def fn(q, k, v):
        w, cap = 12, 7.0

        def near(b, h, qi, ki):
            return (qi - ki).abs() < w

        def soft(s, b, h, qi, ki):
            return cap * torch.tanh(s / cap)

        return attnkit.attention(q, k, v, mask=near, score_mod=soft)

    cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, got = _grads(cf, q, k, v, [])
    eout, eager = _grads(fn, q, k, v, [])
    tol = budget(torch.float32, D, L)
    assert_close(out, eout, tol, "out")
    for a, e in zip(got, eager, strict=True):
        assert_close(a, e, 4 * tol * max(1.0, e.abs().max().item()), "grad")


def test_mask_mod_no_longer_crashes_dynamo():
    """Pin: torch.compile (without fullgraph) over attention with a mask_mod crashed TorchDynamo with
    ``InternalTorchDynamoError: SyntaxError``; it now compiles and matches eager (3-D inputs, lse too)."""
    q, k, v = rand_qkv(1, H, H, L, L, D)
    q, k, v = q[0], k[0], v[0]
    fn = lambda q, k, v: attnkit.attention(q, k, v, mask=lambda b, h, qi, ki: qi >= ki, return_lse=True)  # noqa: E731
    out, lse = torch.compile(fn, backend="aot_eager")(q, k, v)
    eout, else_ = fn(q, k, v)
    assert out.shape == (H, L, D) and lse.shape == (H, L)
    assert_close(out, eout, budget(torch.float32, D, L), "out")
    assert_close(lse, else_, budget(torch.float32, D, L), "lse")


def test_what_the_op_cannot_take_is_named_under_fullgraph():
    """dropout is not in the op: under fullgraph the compile fails with attnkit's message naming it; without
    fullgraph the call breaks the graph and runs eagerly."""
    q, k, v = rand_qkv(1, H, H, L, L, D)
    fn = lambda q, k, v: attnkit.attention(q, k, v, causal=True, dropout_p=0.5)  # noqa: E731
    with pytest.raises(Exception, match=r"dropout_p: under torch\.compile"):
        torch.compile(fn, fullgraph=True, backend="eager")(q, k, v)
    torch.manual_seed(1)
    out = torch.compile(fn, backend="eager")(q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_export_runs_and_equals_eager():
    """torch.export of a module with a document & causal mask, a learnable relative-bias table and sinks: the
    exported program calls attnkit's op with the table as an input, and its output equals eager."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(H, 2 * L - 1) * 0.5)
            self.sinks = torch.nn.Parameter(torch.zeros(H))

        def forward(self, q, k, v, ids):
            return attnkit.attention(q, k, v, mask=M.document(ids) & M.causal(),
                                     score_mod=SM.relative_bias(self.table), sinks=self.sinks)

    m = Layer()
    q, k, v = rand_qkv(1, H, H, L, L, D)
    ep = torch.export.export(m, (q, k, v, IDS))
    assert "attnkit.attention" in ep.graph_module.code
    assert_close(ep.module()(q, k, v, IDS), m(q, k, v, IDS), 0.0, "exported")
    ids2 = torch.tensor([0] * 40 + [1] * 40)  # new data through the same program
    assert_close(ep.module()(q, k, v, ids2), m(q, k, v, ids2), 0.0, "exported, other ids")


def test_the_op_called_directly_has_a_consistent_fake_and_autograd():
    """torch.library.opcheck: schema, fake (meta) implementation and autograd registration agree."""
    from attnkit import _op

    q, k, v = rand_qkv(1, H, H, L, L, D, requires_grad=True)
    table = torch.randn(H, 2 * L - 1, requires_grad=True)
    acc = _op._Acc()
    key = _op._register(True, None, _op._score_spec(_make_rel(table), acc))
    torch.library.opcheck(torch.ops.attnkit.attention.default, (q, k, v, acc.tensors, acc.ints, acc.floats, key, None,
                                                                 "1"),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("name", ["causal", "document", "mask_mod", "score_mod", "softcap_document"])
def test_repeated_compiled_calls_replay_the_forward_bit_for_bit(name, monkeypatch):
    """A compiled model makes the same op call at every layer of every step: from the second call of a signature
    the op replays its prepared forward (attnkit._op._STEPS). Out and every gradient equal the op's full path bit
    for bit, call after call with new inputs; with the mods' tensors edited in place the answer follows."""
    from attnkit import _op

    require_kernel()
    torch._dynamo.reset()  # each case compiles this lambda's code anew (grad and no-grad): keep under the limit
    monkeypatch.setattr(_op, "_STEPS", type(_op._STEPS)())  # signatures earlier tests learned: forgotten
    kw = CALLS[name]
    leaves = [TABLE] if "score_mod" in name else []
    fn = lambda q, k, v: attnkit.attention(q, k, v, **kw)  # noqa: E731
    cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
    real = _op._step_signature
    for step in range(3):
        q, k, v = rand_qkv(B, H, H, L, L, D, requires_grad=True)  # new values each step
        before = set(_op._STEPS)
        out, got = _grads(cf, q, k, v, leaves)
        if step == 0:
            mine = set(_op._STEPS) - before
            assert len(mine) == 1 and _op._STEPS[mine.pop()] is not None, "not prepared for replay"
        else:
            assert set(_op._STEPS) == before, "a repeated call learned again"
        monkeypatch.setattr(_op, "_step_signature", lambda *a: None)  # the op's full path
        try:
            fout, full = _grads(cf, q, k, v, leaves)
        finally:
            monkeypatch.setattr(_op, "_step_signature", real)
        assert torch.equal(out, fout), (name, step)
        for a, b in zip(got, full, strict=True):
            assert torch.equal(a, b), (name, step)
    with torch.no_grad():
        q, k, v = rand_qkv(B, H, H, L, L, D)
        for _ in range(2):
            assert_close(cf(q, k, v), fn(q, k, v), budget(torch.float32, D, L), f"{name}: no grad vs eager")


CAP = 20.0
WIDTH = 16


def _capped(score, b, h, q_idx, kv_idx):  # reads the global CAP live, inside the op
    return CAP * torch.tanh(score / CAP)


def _banded(b, h, q_idx, kv_idx):  # reads the global WIDTH live
    return (q_idx - kv_idx).abs() <= WIDTH


def test_a_replayed_compiled_call_follows_the_globals_its_mods_read(monkeypatch):
    """What a user function reads live (a global number, here) is not in the op's key and is not guarded by
    TorchDynamo: the op reads it inside, at run time. A replayed forward keys it by value, so changing it gives
    the new answer, as eagerly."""
    from attnkit import _op

    torch._dynamo.reset()
    monkeypatch.setattr(_op, "_STEPS", type(_op._STEPS)())
    fn = lambda q, k, v: attnkit.attention(q, k, v, mask=_banded, score_mod=_capped)  # noqa: E731
    cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
    q, k, v = rand_qkv(1, H, H, L, L, D)
    with torch.no_grad():
        for cap, width in ((20.0, 16), (20.0, 16), (0.5, 16), (0.5, 3), (20.0, 16)):
            monkeypatch.setattr(__import__(__name__), "CAP", cap)
            monkeypatch.setattr(__import__(__name__), "WIDTH", width)
            assert_close(cf(q, k, v), fn(q, k, v), budget(torch.float32, D, L), f"cap {cap}, width {width}")


def _sinks_window(b, h, q_idx, kv_idx):  # attention sinks + a window, as the decode rows below see them (S = 300)
    return (kv_idx < 4) | (kv_idx > q_idx + 300 - 4 - 100)


DECODE_CALLS = {
    "causal": dict(mask=M.causal()),
    "window": dict(mask=M.sliding_window(64)),
    "sinks_window_mod": dict(mask=_sinks_window),
    "softcap": dict(mask=M.causal(), score_mod=_softcap),
    "alibi": dict(mask=M.causal(), score_mod=SM.alibi([0.5, 0.25, 0.125, 0.0625])),
}


@pytest.mark.parametrize("Lq", [1, 4])
@pytest.mark.parametrize("name", list(DECODE_CALLS))
def test_a_compiled_decode_step_runs_on_the_decode_entry_as_eager(name, Lq):
    """A decode step (a few query rows over a cache, GQA 4/2) inside torch.compile: the op replays the kernel's
    decode entry, as eager does under no_grad — the same bits as eager, float64 within budget, the decode entry
    called (not the forward's 64-row tiles); with gradients wanted, the op's backward still gives eager's
    gradients within budget."""
    require_kernel()
    from attnkit.backends import _native

    torch._dynamo.reset()  # (each case compiles the same lambda's code: a fresh recompile count)
    kw = DECODE_CALLS[name]
    S = 300
    g = torch.Generator().manual_seed(Lq)
    q, k, v = (torch.randn(1, h, n, D, generator=g) for h, n in ((4, Lq), (2, S), (2, S)))
    fn = lambda q, k, v: attnkit.attention(q, k, v, **kw)  # noqa: E731
    cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
    calls = []
    real = _native.decode_step

    def spy(*a, **kws):
        calls.append(a[0].shape)
        return real(*a, **kws)

    with torch.no_grad():
        eager = fn(q, k, v)
        _native.decode_step = spy
        try:
            outs = [cf(q, k, v) for _ in range(2)]  # (the second: the prepared step replayed)
        finally:
            _native.decode_step = real
    assert calls, "the compiled call did not reach the decode entry"
    assert all(torch.equal(o, eager) for o in outs), name
    kk, vv = (t.repeat_interleave(2, 1) for t in (k, v))
    ref = attnkit.attention(q.double(), kk.double(), vv.double(), backend="reference", **kw)
    assert_close(outs[0], ref, budget(torch.float32, D, S), f"{name}: compiled vs float64")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, got = _grads(cf, qg, kg, vg, [])
    eout, want = _grads(fn, qg, kg, vg, [])
    tol = budget(torch.float32, D, S)
    assert_close(out, eout, tol, f"{name}: out with grad vs eager")
    for what, a, e in zip(["dq", "dk", "dv"], got, want, strict=True):
        assert_close(a, e, 4 * tol * max(1.0, e.abs().max().item()), f"{name}: {what} vs eager")


def test_a_compiled_decode_loop_over_a_growing_cache():
    """A compiled decode loop whose cache grows one key a step: every step's output equals eager's bit for bit."""
    require_kernel()
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    cache_k, cache_v = torch.randn(1, 2, 140, D, generator=g), torch.randn(1, 2, 140, D, generator=g)
    q = torch.randn(1, 4, 1, D, generator=g)
    fn = lambda q, k, v: attnkit.attention(q, k, v, mask=M.sliding_window(32))  # noqa: E731
    cf = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    with torch.no_grad():
        for S in range(128, 136):
            k, v = cache_k[:, :, :S], cache_v[:, :, :S]
            assert torch.equal(cf(q, k, v), fn(q, k, v)), S


def test_a_compiled_decode_step_of_a_packed_qkv():
    """q sliced off a packed (d three) qkv tensor (last dim strided, review finding: the op's decode record refused
    it and raised): the same bits as eager, compiled."""
    require_kernel()
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 2, D, 3, generator=g)[..., 0]
    k, v = torch.randn(1, 2, 96, D, generator=g), torch.randn(1, 2, 96, D, generator=g)
    fn = lambda q, k, v: attnkit.attention(q, k, v, mask=M.causal())  # noqa: E731
    cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(cf(q, k, v), fn(q, k, v))
        assert torch.equal(cf(q, k, v), fn(q, k, v))


S_FEW = 2100  # keys: past the few-rows route's floor (asserted below); 3 query rows, causal as a mask_mod below


@pytest.mark.parametrize("kw", [dict(causal=True), dict(mask=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + S_FEW - 3)],
                         ids=["causal", "mask_mod"])
def test_a_few_rows_with_gradients_over_a_long_cache(kw):
    """A few query rows that want gradients over 2048 keys or more (``auto``'s kernel route eager: its decode-entry
    forward and few-rows backward) under fullgraph=True: out, dq, dk, dv equal eager's and float64's within budget."""
    require_kernel()
    from attnkit.backends.sdpa import FEW_ROWS_GRAD_MIN_KEYS

    S = S_FEW
    assert S >= FEW_ROWS_GRAD_MIN_KEYS
    q, k, v = rand_qkv(1, 8, 2, 3, S, D, requires_grad=True)
    assert attnkit.dispatch(q, k, v, **kw).kernel.name == "native"
    fn = lambda q, k, v: attnkit.attention(q, k, v, **kw)  # noqa: E731
    out, got = _grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v, [])
    eout, eager = _grads(fn, q, k, v, [])
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, want = _grads(lambda q, k, v: attnkit.attention(q, k, v, backend="eager", **kw), qd, kd, vd, [])
    tol = budget(torch.float32, D, S)
    assert_close(out, eout, tol, "out vs eager")
    assert_close(out, ref, tol, "out vs float64")
    for what, a, e, w in zip(["dq", "dk", "dv"], got, eager, want, strict=True):
        scale = max(1.0, w.abs().max().item())
        assert_close(a, w, 4 * tol * scale, f"{what} vs float64")
        assert_close(a, e, 4 * tol * scale, f"{what} vs eager")


def test_autocast_inside_the_compiled_code_answers_as_eager():
    """``torch.autocast`` around attnkit inside a fullgraph-compiled function: bf16 out, as eager and as SDPA, the
    same values as eager, and fp32 gradients reaching the fp32 inputs."""
    q, k, v = rand_qkv(1, 4, 2, 64, 64, 32, requires_grad=True)

    def fn(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return attnkit.attention(q, k, v, causal=True) * 2

    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    want = fn(q, k, v)
    assert out.dtype == want.dtype == torch.bfloat16
    assert_close(out, want, 0.0, "compiled vs eager")
    (g,) = torch.autograd.grad(out.float().sum(), (q,))
    (gw,) = torch.autograd.grad(want.float().sum(), (q,))
    assert g.dtype == torch.float32
    assert_close(g, gw, 1e-6, "dq")


def test_create_block_mask_inside_compiled_code_runs_eagerly_after_an_eager_call():
    """attnkit.create_block_mask called once eagerly, then inside a compiled function: TorchDynamo traced into its
    range evaluation and failed on a module cache keyed by code objects (InternalTorchDynamoError). It now runs
    eagerly from compiled code, as flex_attention does; a block mask rebuilt each step over edited ids is right."""
    L = 48
    q, k, v = (torch.randn(1, 2, L, 8, requires_grad=True) for _ in range(3))
    causal = lambda b, h, qi, kj: kj <= qi  # noqa: E731
    attnkit.create_block_mask(causal, None, None, L, L)

    def step(q, k, v):
        return attnkit.flex_attention(q, k, v, block_mask=attnkit.create_block_mask(causal, None, None, L, L))

    out = torch.compile(step)(q, k, v)
    torch.testing.assert_close(out, attnkit.attention(q, k, v, causal=True))
    doc = torch.arange(L) // 16

    def step2(q, k, v):
        bm = attnkit.create_block_mask(lambda b, h, i, j: doc[i] == doc[j], None, None, L, L)
        return attnkit.flex_attention(q, k, v, block_mask=bm)

    f = torch.compile(step2)
    for s in range(3):
        doc.copy_(torch.arange(L) // (4 + 4 * s))
        torch.testing.assert_close(f(q, k, v), attnkit.attention(q, k, v, mask=attnkit.masks.document(doc.clone())))


def test_flex_attention_with_a_block_mask_compiles_fullgraph_and_matches_float64():
    """attnkit.flex_attention under torch.compile(fullgraph=True): a BlockMask built outside, a score_mod capturing
    a learnable table, GQA. It was opaque to TorchDynamo (a graph break, so fullgraph=True failed); on the CPU it is
    now one call of attnkit's op with the block mask's four kv tensors among its inputs. Forward and every
    gradient (the table's too) against a float64 eager reference; then the block mask's blocks are edited in
    place and a new block mask of the same sizes is passed: both are read when the op runs, no stale blocks."""
    Lq, Hq, Hkv = L, 4, 2
    torch.manual_seed(0)
    q = torch.randn(2, Hq, Lq, D, requires_grad=True)
    k, v = (torch.randn(2, Hkv, Lq, D, requires_grad=True) for _ in range(2))
    table = torch.nn.Parameter(torch.randn(Hq, 2 * Lq - 1) * 0.5)
    make_rel = _make_rel
    rel = make_rel(table)
    doc = IDS.clone()

    def doc_causal(b, h, qi, kj):
        return (doc[qi] == doc[kj]) & (kj <= qi)

    bm = attnkit.create_block_mask(doc_causal, None, None, Lq, Lq, BLOCK_SIZE=16)

    def step(q, k, v, bm):
        return attnkit.flex_attention(q, k, v, score_mod=rel, block_mask=bm, enable_gqa=True)

    cf = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = cf(q, k, v, bm)
    go = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    got = torch.autograd.grad((out * go).sum(), (q, k, v, table))
    qd, kd, vd, td = (x.detach().double().requires_grad_(True) for x in (q, k, v, table))
    want = attnkit.attention(qd, kd, vd, mask=doc_causal, score_mod=make_rel(td), backend="eager")
    wg = torch.autograd.grad((want * go.double()).sum(), (qd, kd, vd, td))
    assert_close(out, want, budget(torch.float32, D, Lq), "compiled flex_attention vs float64")
    for name, g, w in zip(("dq", "dk", "dv", "dtable"), got, wg, strict=True):
        assert_close(g, w, 4 * budget(torch.float32, D, Lq), name)

    # the blocks are read when the op runs: a BlockMask edited in place (every block of the first query block
    # emptied: its rows see no key, output 0), then another one of the same sizes, without a recompile
    from torch._dynamo.utils import counters

    frames = counters["stats"]["unique_graphs"]
    bm.kv_num_blocks[:, :, 0] = 0
    if bm.full_kv_num_blocks is not None:
        bm.full_kv_num_blocks[:, :, 0] = 0
    edited = cf(q, k, v, bm).detach()
    assert edited[:, :, :16].abs().max() == 0 and torch.equal(edited[:, :, 16:], out.detach()[:, :, 16:])
    assert counters["stats"]["unique_graphs"] == frames  # the same graph: the blocks are op inputs
    window = attnkit.create_block_mask(lambda b, h, qi, kj: (qi - kj).abs() <= 5, None, None, Lq, Lq, BLOCK_SIZE=16)
    got_w = cf(q, k, v, window).detach()
    want_w = attnkit.attention(qd, kd, vd, mask=lambda b, h, qi, kj: (qi - kj).abs() <= 5, score_mod=make_rel(td),
                               backend="eager")
    assert_close(got_w, want_w, budget(torch.float32, D, Lq), "a new BlockMask of the same sizes")
    assert counters["stats"]["unique_graphs"] == frames + 1  # its mask_mod is another function: one recompile


def test_flex_attention_with_a_block_mask_of_blocks_only_compiles_fullgraph():
    """BlockMask.from_kv_blocks with no mask_mod (torch's noop_mask): the blocks alone decide, under
    fullgraph=True as eagerly — query block i attends key blocks 0..i, each whole."""
    from torch.nn.attention.flex_attention import BlockMask

    Lq, bs = 64, 16
    n = Lq // bs
    idx = torch.arange(n).expand(1, 1, n, n).contiguous().to(torch.int32)
    nb = torch.arange(1, n + 1, dtype=torch.int32).view(1, 1, n)
    bm = BlockMask.from_kv_blocks(nb, idx, BLOCK_SIZE=bs)
    q, k, v = (torch.randn(1, 2, Lq, D) for _ in range(3))
    got = torch.compile(lambda q, k, v, bm: attnkit.flex_attention(q, k, v, block_mask=bm), fullgraph=True,
                        backend="aot_eager")(q, k, v, bm)
    blocks = lambda b, h, qi, kj: kj // bs <= qi // bs  # noqa: E731
    want = attnkit.attention(q.double(), k.double(), v.double(), mask=blocks, backend="eager")
    assert_close(got, want, budget(torch.float32, D, Lq), "blocks only")
    assert_close(got, attnkit.flex_attention(q, k, v, block_mask=bm), 0.0, "compiled vs eager")


def test_flex_attention_options_under_fullgraph():
    """return_lse, return_aux, scale and kernel_options compile with fullgraph=True and equal the eager call (the
    ignored kernel_options' notice was a warnings.warn TorchDynamo could not trace); an unknown key still fails."""
    from torch.nn.attention.flex_attention import AuxRequest

    q = torch.randn(1, 4, 48, 16)
    k, v = torch.randn(1, 2, 48, 16), torch.randn(1, 2, 48, 16)
    bm = attnkit.create_block_mask(lambda b, h, i, j: i >= j, None, None, 48, 48, BLOCK_SIZE=16)
    calls = {
        "return_lse": dict(return_lse=True), "return_aux": dict(return_aux=AuxRequest(lse=True)),
        "scale": dict(scale=0.3), "kernel_options": dict(kernel_options={"BLOCK_M": 64, "PRESCALE_QK": True}),
    }
    for name, kw in calls.items():
        def f(q, k, v, kw=kw):
            return attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, **kw)

        got, want = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), f(q, k, v)
        if name == "return_aux":
            got, want = (got[0], got[1].lse), (want[0], want[1].lse)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                        strict=True):
            assert_close(g, w, 0.0, name)
    with pytest.raises(Exception, match="unknown key 'BLOCK_Q'"):
        torch.compile(lambda q, k, v: attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                                                             kernel_options={"BLOCK_Q": 1}),
                      fullgraph=True, backend="aot_eager")(q, k, v)
