"""backend="flex": FlexAttention's compiled kernel driven by attnkit's BlockMask (CPU: inference
only), against the float64 reference; auto's GPU table, simulated on the CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, budget, golden, rand_qkv

import attnkit
from attnkit import _dispatch, _mods, _request
from attnkit import masks as M
from attnkit import score_mods as SM

L, S = 200, 260  # awkward: neither divides the 128 tile
IDS = torch.arange(S) // 70


def _doc_mod(b, h, q, kv):
    return (q - kv).abs() <= 40


CASES = {  # one compiled specialisation each (about 5 s apiece on 2 cores): keep the list short
    "none": dict(),
    "causal (bottom-right, L != S)": dict(causal=True),
    "sliding window": dict(mask=M.sliding_window(50)),
    "document": dict(mask=M.document(IDS)),
    "prefix-LM": dict(mask=M.prefix_lm(30)),
    "padding": dict(mask=M.padding([260, 90])),
    "window & document": dict(mask=M.sliding_window(100) & M.document(IDS)),
    "from_mod": dict(mask=_doc_mod),
    "alibi causal": dict(causal=True, score_mod=SM.alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625]))),
    "softcap window": dict(mask=M.sliding_window(64), score_mod=SM.softcap(5.0)),
    "bool tensor": dict(mask=torch.rand(2, 1, L, S) > 0.3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_flex_forward_matches_float64(name):
    q, k, v = rand_qkv(2, 4, 2, L, S, 32, scale=2.0)
    kw = CASES[name]
    ref, _ = golden(q, k, v, **kw)
    with torch.no_grad():
        out = attnkit.attention(q, k, v, backend="flex", **kw)
    assert_close(out, ref, budget(torch.float32, 32, S) * 4, name)


def test_flex_refuses_what_it_cannot_do_on_cpu():
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16, requires_grad=True)
    with pytest.raises(ValueError, match="inference only"):
        attnkit.attention(q, k, v, causal=True, backend="flex")
    with torch.no_grad():
        with pytest.raises(ValueError, match="no lse"):
            attnkit.attention(q, k, v, causal=True, return_lse=True, backend="flex")
        with pytest.raises(ValueError, match="no dropout"):
            attnkit.attention(q, k, v, dropout_p=0.1, backend="flex")
        assert attnkit.dispatch(q, k, v, mask=M.sliding_window(8)).backend != "flex"  # auto never picks it on CPU
        # float64: torch's CPU lowering raised a LoweringException from inside inductor
        with pytest.raises(ValueError, match="takes float32, float16 and bfloat16, not float64"):
            attnkit.attention(q.double(), k.double(), v.double(), causal=True, backend="flex")


def _req(**kw):
    q, k, v = rand_qkv(1, 4, 2, 256, 256, 16)
    full = dict(mask=None, causal=False, scale=None, score_mod=None, dropout_p=0.0, return_lse=False, backend="auto")
    full.update(kw)
    with torch.no_grad():
        return _request.make_request(q, k, v, **full)


@pytest.mark.parametrize("kw,backend", [
    (dict(), "sdpa"),
    (dict(causal=True), "sdpa"),
    (dict(mask=M.sliding_window(64)), "flex"),
    (dict(mask=M.document(torch.arange(256) // 64)), "flex"),
    (dict(causal=True, score_mod=SM.softcap(20.0)), "flex"),
    (dict(mask=torch.randn(1, 1, 256, 256)), "flex"),
    (dict(dropout_p=0.1), "eager"),
])
def test_auto_decision_table_on_cuda_simulated(kw, backend):
    d = _dispatch.auto_backend(_req(**kw), "cuda")
    assert d.backend == backend, d
    assert d.reason


def test_auto_on_cuda_falls_back_when_flex_cannot():
    # a score_mod reading a tensor hidden where attnkit cannot see it: flex cannot wire its gradient
    holder = type("H", (), {})()
    holder.w = torch.ones(1, requires_grad=True)
    box = [holder]
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 8)
    req = _request.make_request(q, k, v, mask=M.sliding_window(8), causal=False, scale=None,
                                score_mod=lambda s, b, h, i, j: s * box[0].w, dropout_p=0.0, return_lse=False,
                                backend="auto")
    d = _dispatch.auto_backend(req, "cuda")
    assert d.backend == "eager" and "neither FlexAttention" in d.reason  # tiled cannot either: eager
    req2 = _request.make_request(q, k, v, mask=M.sliding_window(8), causal=False, scale=None,
                                 score_mod=SM.alibi(torch.ones(2, requires_grad=True)), dropout_p=0.0,
                                 return_lse=False, backend="auto")
    d2 = _dispatch.auto_backend(req2, "cuda")  # learnable slopes: tiled differentiates them, flex is not wired
    assert d2.backend == "tiled" and "FlexAttention cannot" in d2.reason


def test_auto_on_cuda_keeps_a_float_bias_with_gradients_off_flex():
    """FlexAttention's backward rebuilds weights from lse: on a finfo.min row it gives 1 instead of 1/S (measured on
    an H200, tests/backends/test_gpu.py), as SDPA's does; such a call trains on tiled, inference stays on flex."""
    q, k, v = rand_qkv(1, 4, 2, 256, 256, 16)
    bias = torch.randn(1, 1, 256, 256)
    kw = dict(mask=bias, causal=False, scale=None, score_mod=None, dropout_p=0.0, return_lse=False, backend="auto")
    d = _dispatch.auto_backend(_request.make_request(q.requires_grad_(), k, v, **kw), "cuda")
    assert d.backend == "tiled" and "finfo.min" in d.reason, d
    assert _dispatch.auto_backend(_req(mask=bias), "cuda").backend == "flex"


def test_flex_mask_mods_on_a_device_read_copies_made_once():
    """Masks reading a tensor (lengths, ids, flags) hand FlexAttention's GPU kernel a mask_mod over copies already on
    its device (a copy inside a compiled mask_mod fails to compile there): the same answers as bind(), alone and
    combined."""
    L, S = 40, 64
    ids = torch.arange(S) // 9
    valid = torch.rand(2, S) > 0.3
    cases = [M.padding([64, 17]), M.document(ids), M.document(torch.stack([ids, ids.flip(0)])), M.key_padding(valid),
             M.document(ids) & M.padding([50, 30]), M.causal() | M.key_padding(valid), ~M.padding([10, 64])]
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(1).view(1, 1, 1, 1)
    q, kv = torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)
    meta = torch.device("meta")  # stands in for a GPU: where the copies must already be
    for m in cases:
        on = m.flex_mask_mod_on(L, S, torch.device("cpu"))
        assert torch.equal(on(b, h, q, kv).expand(2, 1, L, S), m.bind(L, S)(b, h, q, kv).expand(2, 1, L, S)), m
        far = m.flex_mask_mod_on(L, S, meta)
        assert _mods.data_device(far) == meta, m  # the tensors it reads were moved once, outside the mod
        assert far(*(t.to(meta) for t in (b, h, q, kv))).device == meta, m  # no copy left inside it


def test_score_mods_on_device_equal_their_call():
    s = torch.randn(2, 3, 5, 7)
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(3).view(1, 3, 1, 1)
    q, kv = torch.arange(5).view(1, 1, 5, 1), torch.arange(7).view(1, 1, 1, 7)
    for mod in (SM.alibi(torch.tensor([0.5, 0.25, 0.125])), SM.relative_bias(torch.randn(3, 5)), SM.softcap(3.0)):
        assert torch.equal(mod.on_device(torch.device("cpu"))(s, b, h, q, kv), mod(s, b, h, q, kv)), mod


def test_flex_runs_under_raised_recompile_limits(monkeypatch):
    """Each mask_mod code, dtype and shape is a kernel of its own; past torch.compile's default of 8 torch would run
    flex_attention unfused (every score materialised), so attnkit's call raises the limits for its duration."""
    from attnkit.backends import flex as flex_backend

    seen = []

    def fake(q, k, v, **kw):
        seen.append(torch._dynamo.config.recompile_limit)
        return torch.zeros_like(q)

    monkeypatch.setattr(flex_backend, "_compiled_flex", lambda device_type="cuda": fake)
    with torch.no_grad():
        flex_backend.run(_req(mask=M.sliding_window(64)))
    assert seen == [flex_backend.RECOMPILES] and torch._dynamo.config.recompile_limit < flex_backend.RECOMPILES


@pytest.mark.parametrize("mask", [M.sliding_window(64), M.padding([200]), M.document(torch.arange(256) // 64),
                                  lambda b, h, q, kv: kv <= q + 255 - 3])
def test_decode_on_cuda_goes_to_sdpa_not_flex(mask):
    """A decode step (a few query rows) with a mask: SDPA over the keys it can reach on a GPU too; FlexAttention
    would compile a kernel for every new key count, one a step of a decode loop."""
    q, k, v = rand_qkv(1, 4, 2, 1, 256, 16)
    with torch.no_grad():
        req = _request.make_request(q, k, v, mask=mask, causal=False, scale=None, score_mod=None, dropout_p=0.0,
                                    return_lse=False, backend="auto")
    d = _dispatch.auto_backend(req, "cuda")
    assert d.backend == "sdpa" and "decoding" in d.reason, d


def test_sdpa_dead_rows_and_its_replays_zero_them_off_the_cpu(monkeypatch):
    """Every SDPA path (the full one and the replays _fast runs for a repeated signature) passes its output through
    zero_dead_rows, which on a GPU zeroes the rows the mask leaves no key (a no-op on the CPU, where torch's kernels
    give 0 already); dead_rows reads bool and additive masks of any broadcast shape."""
    from attnkit.backends import sdpa

    m = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    m[1, 0, 2] = False
    assert sdpa.dead_rows(m).tolist() == [[[False, False, False]], [[False, False, True]]]
    f = torch.zeros(3, 5).masked_fill(~m[1, 0], float("-inf"))
    f[0, :2] = float("-inf")  # partly -inf: alive
    assert sdpa.dead_rows(f).tolist() == [False, False, True]
    seen = []
    real = sdpa.zero_dead_rows
    monkeypatch.setattr(sdpa, "zero_dead_rows", lambda out, mask: seen.append(mask is not None) or real(out, mask))
    q, k, v = rand_qkv(1, 4, 4, 1, 64, 16)
    keep = torch.ones(1, 1, 1, 64, dtype=torch.bool)
    for _ in range(3):  # the first call learns, the next replay
        attnkit.attention(q, k, v, mask=keep, backend="sdpa")
        attnkit.attention(q, k, v, mask=M.sliding_window(8), backend="sdpa")
    assert len(seen) >= 6, seen


def test_a_wide_finfo_min_bias_with_fp16_inputs_stays_off_sdpa():
    """fp16 inputs with an fp32 bias of finfo.min padding: the row is the mean of V (as eager gives); SDPA would
    cast the bias to fp16 (-inf: a dead row, 0), so auto takes another path and a named "sdpa" call says why."""
    q, k, v = (t.half() for t in rand_qkv(1, 2, 2, 4, 16, 8))
    bias = torch.zeros(1, 1, 4, 16)
    bias[..., 1, :] = torch.finfo(torch.float32).min
    out = attnkit.attention(q, k, v, mask=bias)
    ref = attnkit.attention(q.double(), k.double(), v.double(), mask=bias.double(), backend="eager")
    assert (out.double() - ref).abs().max() < 5e-3 and out[..., 1, :].abs().max() > 0
    with pytest.raises(ValueError, match=r"finfo\.min padding"):
        attnkit.attention(q, k, v, mask=bias, backend="sdpa")
    assert attnkit.dispatch(q, k, v, mask=bias.half()).backend == "sdpa"  # the mask in the inputs' dtype: SDPA


def test_a_wide_finfo_min_bias_with_bf16_inputs_stays_off_sdpa():
    """A bias wider than the inputs (fp32 with bf16: SDPA would round it to bf16, fp32's finfo.min to -inf): auto
    runs it where the bias stays fp32; its finfo.min row is the mean of V, as eager gives, not a dead row."""
    q, k, v = (t.bfloat16() for t in rand_qkv(1, 2, 2, 4, 16, 8))
    bias = torch.zeros(1, 1, 4, 16)
    bias[..., 1, :] = torch.finfo(torch.float32).min
    bias[..., 2, 3:] = float("-inf")
    out = attnkit.attention(q, k, v, mask=bias)
    ref = attnkit.attention(q.double(), k.double(), v.double(), mask=bias.double(), backend="eager")
    assert (out.double() - ref).abs().max() < 2e-2 and out[..., 1, :].abs().max() > 0
    with pytest.raises(ValueError, match=r"SDPA would round it to torch.bfloat16"):
        attnkit.attention(q, k, v, mask=bias, backend="sdpa")
    assert attnkit.dispatch(q, k, v, mask=bias.bfloat16()).backend == "sdpa"  # the mask in the inputs' dtype
