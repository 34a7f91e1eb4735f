"""What ``attention()`` makes of the caller's inputs, where a wrong reading would be silent: tensors whose
last dim is strided, masks and captured tensors changed between calls (no stale block plan), gradients
into tensors a score_mod captures, integer masks, ``from_torch`` with ``batch_first=False``, score_mod
tensors of the wrong size, FlexAttention-valid mods, and how a mask prints.

Every comparison is against an independent float64 computation (``golden`` runs the NumPy reference
backend; gradients use float64 torch autograd on a dense formula written here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_close, budget, golden, rand_qkv

import attnkit
from attnkit import masks, score_mods
from attnkit.backends import _flash_cpu


def dense_ref(q, k, v, *, score_mod=None, bias=None, allowed=None, scale=None):
    """Float64 attention by the formula, differentiable (q, k, v already float64)."""
    B, H, L, D = q.shape
    g = H // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    if score_mod is not None:
        b = torch.arange(B).view(-1, 1, 1, 1)
        h = torch.arange(H).view(1, -1, 1, 1)
        i = torch.arange(L).view(1, 1, -1, 1)
        j = torch.arange(k.shape[2]).view(1, 1, 1, -1)
        s = score_mod(s, b, h, i, j)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    return (p / torch.where(den > 0, den, torch.ones_like(den))) @ vv


# --- a last dim with stride != 1 (torch's private kernel must not see it) ------------------

def _strided(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "step2":  # x[..., ::2]
        return torch.stack([t, torch.full_like(t, 99.0)], dim=-1).flatten(-2)[..., ::2]
    if how == "transposed_last":  # a (B, H, D, L) buffer viewed as (B, H, L, D): last-dim stride L
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "as_strided":
        buf = torch.full((t.numel() * 3,), 99.0, dtype=t.dtype)
        B, H, L, D = t.shape
        view = buf.as_strided(t.shape, (H * L * D * 3, L * D * 3, 3, L * 3))
        view.copy_(t)
        return view
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["step2", "transposed_last", "as_strided"])
@pytest.mark.parametrize("backend", ["tiled", "auto", "sdpa", "eager"])
@pytest.mark.parametrize("case", ["window", "causal_br", "dense_lse"])
def test_last_dim_stride_is_exact(how, backend, case):
    q, k, v = rand_qkv(2, 4, 2, 70, 93, 16)
    kw = {"window": dict(mask=masks.sliding_window(9)), "causal_br": dict(causal=True),
          "dense_lse": dict()}[case]
    qs, ks, vs = _strided(q, how), _strided(k, how), _strided(v, how)
    assert ks.stride(-1) != 1
    ref, ref_lse = golden(q, k, v, **kw)
    for _ in range(3):  # the old error changed from call to call
        out, lse = attnkit.attention(qs, ks, vs, return_lse=True, backend=backend, **kw)
        assert_close(out, ref, budget(torch.float32, 16, 93), f"{backend} {how} {case}")
        assert_close(lse, ref_lse, budget(torch.float32, 16, 93), f"{backend} {how} {case} lse")


def test_stride_grads_tiled():
    q, k, v = rand_qkv(1, 2, 1, 40, 70, 8)
    leaves = [_strided(t, "step2").detach().requires_grad_() for t in (q, k, v)]
    qs, ks, vs = leaves
    out = attnkit.attention(qs, ks, vs, mask=masks.sliding_window(7), backend="tiled")
    out.square().sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    allowed = masks.sliding_window(7).materialize(1, 2, 40, 70)
    dense_ref(q64, k64, v64, allowed=allowed).square().sum().backward()
    for got, want, n in zip(leaves, (q64, k64, v64), "qkv", strict=True):
        assert_close(got.grad, want.grad, 1e-4, f"d{n}")


def test_fit_copies_only_when_needed():
    x = torch.randn(2, 3, 5, 8)
    assert _flash_cpu.fit(x) is x
    t = torch.randn(2, 5, 3, 8).transpose(1, 2)  # leading dims transposed: read correctly, no copy
    assert _flash_cpu.fit(t) is t
    e = torch.randn(1, 3, 5, 8).expand(4, -1, -1, -1)  # stride-0 batch: no copy
    assert _flash_cpu.fit(e) is e
    s = x[..., ::2]
    f = _flash_cpu.fit(s)
    assert f is not s and f.stride(-1) == 1 and torch.equal(f, s)


# --- masks and captured data changed between calls: no stale block plan -----------------

@pytest.mark.parametrize("backend", ["tiled", "auto"])
def test_mask_mod_closure_data_changes_between_calls(backend):
    L = 256
    q, k, v = rand_qkv(1, 2, 2, L, L, 16)
    doc = torch.zeros(L, dtype=torch.long)
    doc[100:] = 1

    def same_doc(b, h, qi, kv):
        return doc[qi] == doc[kv]

    for boundary in (100, 30, 200, 64):  # the next packed batch: new boundaries, same function
        doc.zero_()
        doc[boundary:] = 1
        ref, _ = golden(q, k, v, mask=masks.document(doc.clone()))
        out = attnkit.attention(q, k, v, mask=same_doc, backend=backend)
        assert_close(out, ref, budget(torch.float32, 16, L), f"boundary {boundary}")
        out = attnkit.attention(q, k, v, mask=masks.from_mod(same_doc), backend=backend)
        assert_close(out, ref, budget(torch.float32, 16, L), f"from_mod boundary {boundary}")


def test_builtin_masks_are_values():
    L = 192
    q, k, v = rand_qkv(2, 2, 2, L, L, 8)
    ids = torch.zeros(L, dtype=torch.long)
    ids[70:] = 1
    doc = masks.document(ids)
    ref, _ = golden(q, k, v, mask=masks.document(ids.clone()))
    assert_close(attnkit.attention(q, k, v, mask=doc, backend="tiled"), ref, budget(torch.float32, 8, L))
    ids[:] = 5  # the caller reuses its buffer for the next batch: the mask object must not change
    assert_close(attnkit.attention(q, k, v, mask=doc, backend="tiled"), ref, budget(torch.float32, 8, L))
    lengths = torch.tensor([150, 40])
    pad = masks.padding(lengths)
    ref_p, _ = golden(q, k, v, mask=masks.padding([150, 40]))
    assert_close(attnkit.attention(q, k, v, mask=pad, backend="tiled"), ref_p, budget(torch.float32, 8, L))
    lengths[0] = 10
    assert_close(attnkit.attention(q, k, v, mask=pad, backend="tiled"), ref_p, budget(torch.float32, 8, L))


def test_dense_mask_changed_in_place_and_through_numpy():
    L = 200
    q, k, v = rand_qkv(1, 2, 2, L, L, 8)
    arr = np.tril(np.ones((L, L), dtype=bool))
    m = torch.from_numpy(arr)  # shares memory with arr: a NumPy write does not bump torch's version
    for step in range(3):
        ref, _ = golden(q, k, v, mask=m.clone())
        out = attnkit.attention(q, k, v, mask=m, backend="tiled")
        assert_close(out, ref, budget(torch.float32, 8, L), f"step {step}")
        arr[:, : 50 * (step + 1)] = False  # change the mask through NumPy
        arr[:, 50 * (step + 1):] = np.tril(np.ones((L, L), dtype=bool))[:, 50 * (step + 1):]


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float16(0.25), np.float64(0.3), np.int64(2), 3, -0.5, 0])
@pytest.mark.parametrize("backend", ["auto", "tiled", "sdpa", "eager"])
def test_scale_any_real_number(scale, backend):
    """A NumPy scalar (float32 from ``1 / np.sqrt(np.float32(d))``, an integer) is a scale as a Python number is: its
    exact value, on every backend; the fast path's replay too (called twice)."""
    q, k, v = rand_qkv(1, 4, 2, 5, 9, 8)
    ref, _ = golden(q, k, v, scale=float(scale), causal=True)
    for _ in range(2):
        out = attnkit.attention(q, k, v, scale=scale, causal=True, backend=backend)
        assert_close(out, ref, budget(torch.float32, 8, 9), f"{scale!r} {backend}")


@pytest.mark.parametrize("how", ["flag", "broadcast_to", "frombuffer"])
def test_read_only_numpy_inputs_and_mask_run_without_a_warning(how, recwarn):
    """A read-only array (a read-only memmap, ``np.frombuffer`` of bytes, ``np.broadcast_to``) is read as any other;
    torch's "The given NumPy array is not writable" warning, which the caller can do nothing about, is not raised."""
    rng = np.random.default_rng(3)
    L, S, D = 6, 9, 8

    def ro(a):
        if how == "flag":
            a = a.copy()
            a.flags.writeable = False
            return a
        if how == "frombuffer":
            return np.frombuffer(a.tobytes(), dtype=a.dtype).reshape(a.shape)
        return np.broadcast_to(a[:1], a.shape)  # (rows alike: a view of stride 0)

    q, k, v = (rng.standard_normal((1, 2, n, D)).astype(np.float32) for n in (L, S, S))
    keep = rng.random((L, S)) < 0.7
    keep[:, 0] = True
    args = [ro(x) for x in (q, k, v)]
    mask = ro(keep)
    assert all(not a.flags.writeable for a in args) and not mask.flags.writeable
    for backend in ("auto", "tiled", "eager"):
        out = attnkit.attention(*args, mask=mask, backend=backend)
        ref, _ = golden(*(np.array(a) for a in args), mask=np.array(mask))
        assert isinstance(out, np.ndarray)
        assert_close(torch.from_numpy(out), ref, budget(torch.float32, D, S), backend)
    assert not [w for w in recwarn if "not writable" in str(w.message)]


def test_unchanged_builtin_mask_plan_is_reused():
    """Built-in masks stay cached by value (speed): the same object plans once per size."""
    from attnkit.backends import _worklist as _blocks
    m = masks.sliding_window(32)
    p1 = _blocks.work_list(m, None, 1, 2, 512, 512, 64, 64, 1024)
    p2 = _blocks.work_list(m, None, 1, 2, 512, 512, 64, 64, 1024)
    assert p1 is p2
    # a pure mask_mod (reads only its indices and constants) is cached by its value key ...
    f = masks.from_mod(lambda b, h, i, j: j <= i)
    w1 = _blocks.work_list(f, None, 1, 2, 512, 512, 64, 64, 1024)
    assert _blocks.work_list(f, None, 1, 2, 512, 512, 64, 64, 1024) is w1
    # ... one that reads a tensor is keyed by the tensor's content, taken on every call: reused while the
    # data is the same, planned anew once it is edited in place (never a stale plan)
    ids = torch.zeros(512, dtype=torch.long)
    g = masks.from_mod(lambda b, h, i, j: ids[i] == ids[j])
    w2 = _blocks.work_list(g, None, 1, 2, 512, 512, 64, 64, 1024)
    assert _blocks.work_list(g, None, 1, 2, 512, 512, 64, 64, 1024) is w2
    ids[256:] = 1  # the next packed batch, written into the same tensor
    w3 = _blocks.work_list(g, None, 1, 2, 512, 512, 64, 64, 1024)
    assert w3 is not w2 and w3.density < w2.density
    # ... and one reading a global number is keyed by that number's value
    global _WIDTH
    _WIDTH = 64
    h = masks.from_mod(_band_global)
    d1 = _blocks.work_list(h, None, 1, 1, 512, 512, 64, 64, 1024).density
    _WIDTH = 300
    d2 = _blocks.work_list(h, None, 1, 1, 512, 512, 64, 64, 1024).density
    assert d2 > d1


_WIDTH = 64


def _band_global(b, h, q, kv):
    return (q - kv).abs() <= _WIDTH


# --- gradients into tensors a score_mod captures ----------------------------------------

def _grad_case(backend, bias_requires_qkv=True, L=80, S=80):
    torch.manual_seed(1)
    q, k, v = rand_qkv(1, 2, 2, L, S, 8)
    table = torch.randn(L + S, requires_grad=True)

    def mod(s, b, h, i, j):
        return s + table[(i - j).abs()]

    leaves = [t.detach().clone().requires_grad_(bias_requires_qkv) for t in (q, k, v)]
    out = attnkit.attention(*leaves, score_mod=mod, causal=True, backend=backend)
    out.square().sum().backward()
    t64 = table.detach().double().requires_grad_()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    allowed = masks.causal().materialize(1, 2, L, S)
    dense_ref(q64, k64, v64, score_mod=lambda s, b, h, i, j: s + t64[(i - j).abs()],
              allowed=allowed).square().sum().backward()
    assert table.grad is not None, f"{backend}: gradient into the captured table was dropped"
    assert_close(table.grad, t64.grad, 1e-4, f"{backend} d table")
    if bias_requires_qkv:
        for got, want, n in zip(leaves, (q64, k64, v64), "qkv", strict=True):
            assert_close(got.grad, want.grad, 1e-4, f"{backend} d{n}")


@pytest.mark.parametrize("backend", ["tiled", "auto", "eager"])
def test_captured_tensor_gets_gradient(backend):
    _grad_case(backend)


@pytest.mark.parametrize("backend", ["tiled", "auto"])
def test_only_captured_tensor_requires_grad(backend):
    _grad_case(backend, bias_requires_qkv=False)


@pytest.mark.parametrize("backend", ["tiled", "auto", "eager"])
@pytest.mark.parametrize("which", ["alibi", "relative_bias"])
def test_builtin_score_mod_tensors_learn(backend, which):
    q, k, v = rand_qkv(1, 4, 2, 70, 70, 8, requires_grad=True)
    if which == "alibi":
        param = torch.rand(4, requires_grad=True)
        mod, mk = score_mods.alibi(param), score_mods.alibi
    else:
        param = torch.randn(4, 9, requires_grad=True)
        mod, mk = score_mods.relative_bias(param), score_mods.relative_bias
    attnkit.attention(q, k, v, score_mod=mod, causal=True, backend=backend).sum().backward()
    p64 = param.detach().double().requires_grad_()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    dense_ref(q64, k64, v64, score_mod=mk(p64), allowed=masks.causal().materialize(1, 4, 70, 70)).sum().backward()
    assert param.grad is not None
    assert_close(param.grad, p64.grad, 1e-4, f"{backend} {which}")
    assert_close(q.grad, q64.grad, 1e-4, "dq")


@pytest.mark.parametrize("backend", ["tiled", "auto", "eager", "sdpa"])
def test_float_mask_gets_gradient(backend):
    q, k, v = rand_qkv(2, 2, 2, 70, 90, 8, requires_grad=True)
    bias = torch.randn(2, 1, 1, 90, requires_grad=True)  # broadcast over heads and rows
    attnkit.attention(q, k, v, mask=bias, backend=backend).square().sum().backward()
    b64 = bias.detach().double().requires_grad_()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    dense_ref(q64, k64, v64, bias=b64).square().sum().backward()
    assert_close(bias.grad, b64.grad, 1e-4, f"{backend} d bias")


def test_hidden_tensor_refused_by_tiled_and_exact_on_auto():
    holder = type("Holder", (), {})()
    holder.w = torch.randn(1, requires_grad=True)
    box = {"h": holder}

    def mod(s, b, h, i, j):  # reads holder.w through an object attribute attnkit does not search
        return s * box["h"].w

    q, k, v = rand_qkv(1, 2, 2, 20, 20, 8)
    with pytest.raises(ValueError, match="cannot find"):
        attnkit.attention(q, k, v, score_mod=mod, backend="tiled")
    assert attnkit.dispatch(q, k, v, score_mod=mod).backend == "eager"
    attnkit.attention(q, k, v, score_mod=mod).sum().backward()
    assert holder.w.grad is not None and torch.isfinite(holder.w.grad).all()


# --- integer masks ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_int_mask_error_suggests_bool(kind):
    q, k, v = rand_qkv(1, 1, 1, 4, 4, 8)
    m = np.tril(np.ones((4, 4), dtype=np.int64))
    if kind == "torch":
        m = torch.from_numpy(m)
    else:
        q, k, v = q.numpy(), k.numpy(), v.numpy()
    with pytest.raises(TypeError) as e:
        attnkit.attention(q, k, v, mask=m)
    msg = str(e.value)
    assert "astype(bool)" in msg and "bool()" in msg and "astype(np.float32)" not in msg
    # following the advice gives the causal result
    fixed = m.astype(bool) if kind == "numpy" else m.bool()
    ref, _ = golden(q, k, v, causal=True)
    assert_close(attnkit.attention(q, k, v, mask=fixed), ref, 1e-5)


# --- from_torch with batch_first=False -------------------------------------------------

@pytest.mark.parametrize("batch_first", [False, True])
def test_from_torch_keeps_batch_first(batch_first):
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(16, 4, batch_first=batch_first).eval()
    ours = attnkit.nn.MultiHeadAttention.from_torch(tm).eval()
    x = torch.randn(5, 3, 16)  # (L, B, E) for batch_first=False, (B, L, E) otherwise
    want, _ = tm(x, x, x, need_weights=False)
    got = ours(x)
    assert got.shape == want.shape
    assert_close(got, want, 1e-5, f"batch_first={batch_first}")
    back = ours.to_torch()
    assert back.batch_first == batch_first


# --- score_mod tensors of the wrong size -----------------------------------------------

def test_alibi_slopes_must_match_heads():
    q, k, v = rand_qkv(1, 4, 4, 8, 8, 8)
    for n in (3, 5):
        with pytest.raises(ValueError, match=r"one slope per query head \(H=4\), got " + str(n)):
            attnkit.attention(q, k, v, score_mod=score_mods.alibi(torch.ones(n)))


@pytest.mark.parametrize("rows", [2, 8])
def test_relative_bias_rows_must_match_heads(rows):
    q, k, v = rand_qkv(1, 4, 4, 8, 8, 8)
    with pytest.raises(ValueError, match=rf"one row per query head \(H=4\), got {rows} rows"):
        attnkit.attention(q, k, v, score_mod=score_mods.relative_bias(torch.zeros(rows, 5)))


# --- FlexAttention-valid mods ------------------------------------------------------------

def test_mod_with_default_argument_is_a_mask_mod():
    w = 3

    def band(b, h, q_idx, kv_idx, w=w):
        return (q_idx - kv_idx).abs() <= w

    q, k, v = rand_qkv(1, 2, 2, 30, 30, 8)
    ref, _ = golden(q, k, v, mask=masks.from_mod(lambda b, h, i, j: (i - j).abs() <= 3))
    for backend in ("tiled", "auto", "eager", "reference"):
        assert_close(attnkit.attention(q, k, v, mask=band, backend=backend), ref, 1e-5, backend)

    def mod(score, b, h, q_idx, kv_idx, scale=0.5):
        return score * scale

    ref2, _ = golden(q, k, v, scale=8 ** -0.5 * 0.5)
    assert_close(attnkit.attention(q, k, v, score_mod=mod), ref2, 1e-5, "score_mod with default")


def test_chained_indexing_matches_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention
    torch.manual_seed(3)
    B, H, L = 2, 2, 24
    q, k, v = rand_qkv(B, H, H, L, L, 8)
    bias = torch.randn(B, L)
    keep = torch.rand(B, L) > 0.3

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + bias[b][q_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return keep[b][kv_idx] | (q_idx == kv_idx)

    from torch.nn.attention.flex_attention import create_block_mask
    bm = create_block_mask(mask_mod, B, H, L, L, device="cpu")
    want = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    for backend in ("tiled", "auto", "eager", "reference"):
        got = attnkit.attention(q, k, v, score_mod=score_mod, mask=mask_mod, backend=backend)
        assert_close(got, want, 1e-5, backend)


def test_mod_with_wrong_shape_fails_loudly():
    q, k, v = rand_qkv(1, 2, 2, 8, 8, 8)
    with pytest.raises((ValueError, TypeError, RuntimeError)):
        attnkit.attention(q, k, v, mask=lambda b, h, i, j: torch.ones(3, 3, 3, 3, 3, dtype=torch.bool))


# --- printing masks ------------------------------------------------------------------------

def test_print_document_mask_draws_it():
    text = str(masks.document([0, 0, 1]))
    rows = text.splitlines()
    assert rows[0].startswith("document(")
    assert rows[-3:] == ["q0 # # .", "q1 # # .", "q2 . . #"]
    assert "q2 . . #" in str(masks.document([0, 0, 1]) & masks.causal())


@pytest.mark.parametrize("L, S, backend", [(32, 32, "auto"), (512, 512, "auto"), (1, 4096, "auto"),
                                           (64, 64, "tiled"), (64, 64, "eager"), (64, 64, "sdpa")])
def test_under_autocast_every_path_answers_as_sdpa_does(L, S, backend):
    """Under ``torch.autocast("cpu", bfloat16)`` torch SDPA takes fp32 q, k, v in bf16 and answers in bf16; so does
    attnkit on every path (before, the output's dtype depended on which backend the size picked: bf16 from SDPA,
    fp32 from the kernel). The gradients reach the fp32 inputs in fp32; float64 is left alone, as autocast leaves
    it; outside autocast the same call answers in fp32 again (nothing remembered from inside)."""
    q, k, v = rand_qkv(1, 4, 2, L, S, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attnkit.attention(q, k, v, causal=True, backend=backend)
        d = attnkit.dispatch(q, k, v, causal=True, backend=backend)
        want_dtype = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=L == S, enable_gqa=True).dtype
        r64 = attnkit.attention(q.double(), k.double(), v.double(), causal=True, backend="eager")
    assert out.dtype == want_dtype == torch.bfloat16 and r64.dtype == torch.float64, d
    go = torch.randn_like(r64)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attnkit.attention(qd, kd, vd, causal=True, backend="eager")
    assert_close(out, ref, 8 * budget(torch.bfloat16, 64, S), f"{d.backend}/{d.worker} output")
    got = torch.autograd.grad((out.double() * go).sum(), (q, k, v))
    want = torch.autograd.grad((ref * go).sum(), (qd, kd, vd))
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.dtype == torch.float32
        assert_close(a, b, 8 * budget(torch.bfloat16, 64, S) * max(1.0, b.abs().max().item()), f"d{name}")
    for _ in range(2):
        assert attnkit.attention(q, k, v, causal=True, backend=backend).dtype == torch.float32


@pytest.mark.parametrize("backend", ["auto", "tiled", "sdpa", "eager"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_lazily_negated_tensor_is_read_as_its_values(backend, causal):
    """torch._neg_view(-x) equals x, its memory holding -x and a neg bit: the compiled kernel read the memory (the
    scores of -q, off by order 1, on the first call too) and SDPA's causal kernel as well. Every path reads the
    values; output and gradients against float64 of the plain tensors."""
    q, k, v = rand_qkv(1, 2, 2, 40, 70, 16)
    ref = attnkit.attention(q.double(), k.double(), v.double(), causal=causal)
    for which in range(3):
        plain = [t.clone().requires_grad_() for t in (q, k, v)]
        args = [torch._neg_view(-t) if i == which else t for i, t in enumerate(plain)]
        assert torch.equal(args[which], plain[which])
        out = attnkit.attention(*args, causal=causal, backend=backend)
        assert_close(out, ref, budget(torch.float32, 16, 70))
        got = torch.autograd.grad(out.sum(), plain)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        want = torch.autograd.grad(attnkit.attention(q64, k64, v64, causal=causal).sum(), (q64, k64, v64))
        for a, b in zip(got, want, strict=True):
            assert_close(a, b, 4 * budget(torch.float32, 16, 70))


def _many_calls():
    """One sample of every route a CPU call takes (the kernel's forward with lse, replayed calls, a window, a soft
    cap, a bool tensor mask, a decode step, and a backward), on fp32 inputs made here with their dtype and device
    named: the answers as a flat list."""
    g = torch.Generator().manual_seed(11)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32, device="cpu")

    q, k, v = r(1, 4, 200, 32), r(1, 4, 200, 32), r(1, 4, 200, 32)
    qd, kd, vd = r(1, 8, 1, 64), r(1, 2, 300, 64), r(1, 2, 300, 64)
    keep = torch.rand(200, 200, generator=g, dtype=torch.float32, device="cpu") > 0.3
    out: list = []
    for kw in (dict(causal=True), dict(mask=masks.sliding_window(64)), dict(mask=keep),
               dict(causal=True, score_mod=lambda s, b, h, i, j: 20 * torch.tanh(s / 20))):
        out += attnkit.attention(q, k, v, return_lse=True, **kw)
        out += [attnkit.attention(q, k, v, **kw) for _ in range(2)]  # learned, then replayed
    out += [attnkit.attention(qd, kd, vd, causal=True) for _ in range(2)]
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    o = attnkit.attention(qq, kk, vv, causal=True)
    o.backward(torch.ones_like(o))
    return [*out, o.detach(), qq.grad, kk.grad, vv.grad]


def test_torchs_default_dtype_changes_no_answer():
    """``torch.set_default_dtype(torch.float64)`` (scientific code sets it) must not reach the buffers the compiled
    kernel writes: its fp32 outputs, lse and gradients were float64 buffers it wrote fp32 into — a wrong answer, 52
    off in the forward with lse and 175 in a gradient. Every route gives the same bits as with the fp32 default."""
    from attnkit import _fast

    want = _many_calls()
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _fast.clear()
        got = _many_calls()
    finally:
        torch.set_default_dtype(before)
        _fast.clear()
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), i


@pytest.mark.parametrize("how", ["context", "set_default_device"])
def test_a_default_device_elsewhere_changes_no_answer_for_cpu_tensors(how):
    """CPU tensors under another default device (``with torch.device("meta")``; ``torch.set_default_device``, as
    on a GPU machine): attnkit's CPU paths allocate their buffers on the CPU, not on the default device (a bool mask
    read into a tile map on the meta device crashed the process; a decode step refused its own CPU tensors). Every
    route gives the same bits as without it, and ``dispatch`` answers."""
    from attnkit import _fast

    want = _many_calls()
    q = torch.zeros(1, 2, 64, 16, dtype=torch.float32, device="cpu")
    _fast.clear()
    try:
        if how == "context":
            with torch.device("meta"):
                got = _many_calls()
                said = attnkit.dispatch(q, q, q, mask=torch.ones(64, 64, dtype=torch.bool, device="cpu"))
        else:
            torch.set_default_device("meta")
            try:
                got = _many_calls()
                said = attnkit.dispatch(q, q, q, mask=torch.ones(64, 64, dtype=torch.bool, device="cpu"))
            finally:
                torch.set_default_device(None)  # (not "cpu": that leaves a device mode on for the process)
    finally:
        _fast.clear()
    assert not torch._C._is_torch_function_mode_enabled()
    assert said.backend and said.reason
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.device.type == "cpu" and torch.equal(a, b), i
