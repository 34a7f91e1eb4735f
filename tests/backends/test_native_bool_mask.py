"""A user's bool tensor mask on the compiled kernel: its 64 × 64 tiles read off its values (``_tilebits.dense_bits``:
empty tiles skipped, full ones attended whole, each partial tile masked by its own bits), forward and backward; and
the replayed bf16 call with gradients that ``auto`` sends there, its tile map keyed by the mask's content.

Error budget: the fp32 kernel's, ``16 eps (sqrt(D) + sqrt(S))`` against the float64 golden (gradients 4x that of the
largest), as every other mask on the kernel (test_native_kernel.py); bf16, one bf16 unit of the largest value plus
the fp32 budget (the output and each gradient rounded once to bf16; on a CPU with AMX the products of P and dS are
rounded to bf16 too: test_native_amx.py's 4 units for gradients).
"""

from __future__ import annotations

import pytest
import torch
from conftest import EPS, assert_close, budget, golden, require_kernel

import attnkit
from attnkit.backends import _tilebits, native

pytestmark = pytest.mark.usefixtures("kernel_takes_bf16")


def _mask(shape, seed, L, S):
    """Random 70 % keys, with an empty 64 x 64 tile, a full one, rows that see no key, one row of one key."""
    m = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < 0.7
    m[..., :64, 64:128] = False  # an empty tile (where S > 64)
    m[..., 64:128, :64] = True  # a full tile (where L > 64)
    m[..., 3, :] = False  # a row that sees nothing
    m[..., 5, :] = False
    m[..., 5, 10] = True  # a row of one key
    return m


SHAPES = [  # B, H, L, S, D, the mask's shape (broadcast to (B, H, L, S))
    (2, 3, 64, 64, 32, "LS"),
    (1, 2, 100, 150, 40, "B1LS"),
    (2, 2, 130, 70, 16, "1HLS"),
    (2, 2, 193, 200, 64, "BHLS"),
]


def _shape(kind, B, H, L, S):
    return {"LS": (L, S), "B1LS": (B, 1, L, S), "1HLS": (1, H, L, S), "BHLS": (B, H, L, S)}[kind]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}L{}S{}D{}-{}".format(*s))
def test_a_bool_tensor_mask_on_the_kernel_matches_float64(shape):
    """fp32 forward, lse and gradients against float64, every mask shape the API broadcasts; the tile map holds the
    mask's empty, full and partial tiles (its bits the mask's own: unpacked, the same mask)."""
    require_kernel()
    B, H, L, S, D, kind = shape
    mask = _mask(_shape(kind, B, H, L, S), 1, L, S)
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64).float().requires_grad_() for n in (L, S, S))
    assert attnkit.dispatch(q, k, v, mask=mask, backend="tiled").worker == "native"
    out, lse = attnkit.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    ref, ref_lse = golden(q, k, v, mask=mask)
    tol = budget(torch.float32, D, S)
    assert_close(out, ref, tol, "out")
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live), "rows that see no key: lse -inf exactly there"
    assert_close(lse[live], ref_lse[live], tol, "lse")
    assert (out[~live] == 0).all(), "rows that see no key: output 0"
    go = torch.randn_like(out)
    grads = torch.autograd.grad((out * go).sum(), (q, k, v))
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad((attnkit.attention(q2, k2, v2, mask=mask, backend="eager") * go.double()).sum(),
                               (q2, k2, v2))
    for name, a, b in zip("qkv", grads, want, strict=True):
        assert_close(a, b, 4 * tol * max(1.0, b.abs().max().item()), f"d{name}")
    m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    tb = _tilebits.dense_bits(m4, L, S)
    assert {0, 1, 2} <= set(tb.kinds.unique().tolist()) or L <= 64, "empty, partial and full tiles"
    assert torch.equal(_tilebits.unpack(tb, B, H, L, S), m4.expand(B, H, L, S)), "the tile map is the mask"


@pytest.mark.parametrize("kind", ["documents", "key padding (B, 1, 1, S)", "a prefix of keys (1, S)"])
def test_auto_sends_a_structured_bool_mask_to_the_kernel(kind):
    """Through ``auto``: a bool mask with most tiles empty or full goes to the kernel (its route's tile summary of the
    mask reused for the kernel's map), a mask broadcast over rows too; the answer within the fp32 budget of float64,
    dead rows 0; and the same tensor edited in place is read as it is at the next call."""
    require_kernel()
    B, H, L, S, D = 2, 2, 200, 260, 32
    if kind == "documents":
        i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
        mask = (i // 70 == j // 90) & (j <= i + 60)
    elif kind.startswith("key padding"):
        mask = (torch.arange(S) < torch.tensor([S, 130])[:, None]).reshape(B, 1, 1, S)
    else:
        mask = (torch.arange(S) < 150).reshape(1, S)
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64).float() for n in (L, S, S))
    for step in range(2):
        d = attnkit.dispatch(q, k, v, mask=mask)
        assert d.worker == "native", d
        out = attnkit.attention(q, k, v, mask=mask)
        ref, ref_lse = golden(q, k, v, mask=mask)
        assert_close(out, ref, budget(torch.float32, D, S), f"{kind} step {step}")
        assert (out[~torch.isfinite(ref_lse)] == 0).all()
        m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        tb = _tilebits.dense_bits(m4, L, S)  # (gathered from the broadcast mask: only its partial tiles' points)
        assert torch.equal(_tilebits.unpack(tb, B, H, L, S), m4.expand(B, H, L, S)), "the tile map is the mask"
        mask[..., :64] = False  # edited in place: the next call reads it so (rows seeing only those keys die)


def _bf16_step(q, k, v, mask, go):
    out = attnkit.attention(q, k, v, mask=mask)
    return (out, *torch.autograd.grad(out, (q, k, v), go))


def _bf16_want(q, k, v, mask, go):
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = attnkit.attention(q2, k2, v2, mask=mask, backend="eager")
    return (out, *torch.autograd.grad(out, (q2, k2, v2), go.double()))


def _bf16_close(got, want, D, S, what):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        top = max(1.0, b.abs().max().item())
        tol = (4 if name != "out" else 1) * EPS[torch.bfloat16] * top + budget(torch.float32, D, S, top)
        assert a.dtype is torch.bfloat16, (what, name)
        assert (a.double() - b).abs().max().item() <= tol, (what, name, (a.double() - b).abs().max().item(), tol)


@pytest.mark.parametrize("L,S", [(64, 64), (100, 130)])
def test_bf16_with_gradients_replays_the_kernel_by_the_mask_content(L, S):
    """``auto`` sends a bf16 call with gradients and a bool tensor mask to the kernel (its prepared forward and
    backward, replayed): each call runs the tile map of *its* mask — the same mask edited in place, then five other
    masks in turn (more than the contents a signature keeps), then the first again — every output and gradient
    within the bf16 budget of float64 on that call's mask; dead rows give 0 and no NaN."""
    require_kernel()
    B, H, D = 1, 4, 32
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, n, D, generator=g).bfloat16().requires_grad_() for n in (L, S, S))
    go = torch.randn(B, H, L, D, generator=g).bfloat16()
    mask = _mask((L, S), 1, L, S)
    d = attnkit.dispatch(q, k, v, mask=mask)
    assert d.worker == "native", d
    masks = [mask] + [_mask((L, S), 10 + i, L, S) for i in range(5)]
    for step in range(3):  # the first call learns, the rest replay
        _bf16_close(_bf16_step(q, k, v, mask, go), _bf16_want(q, k, v, mask, go), D, S, f"step {step}")
    mask[7:20] = ~mask[7:20]  # edited in place: a new content
    mask[7:20, 0] = True
    _bf16_close(_bf16_step(q, k, v, mask, go), _bf16_want(q, k, v, mask, go), D, S, "edited")
    for i, m in enumerate([*masks[1:], mask]):
        got = _bf16_step(q, k, v, m, go)
        _bf16_close(got, _bf16_want(q, k, v, m, go), D, S, f"mask {i}")
        assert (got[0][..., 3, :] == 0).all() and not got[0].isnan().any()


def test_the_replay_keeps_a_frozen_copy_of_each_mask():
    """The prepared call of a mask content holds its own copy: a mask edited in place after its call changes nothing
    a later call of the earlier content reads (that call gets its own content's answer)."""
    require_kernel()
    L = S = 64
    q, k, v = (torch.randn(1, 2, 64, 16).bfloat16().requires_grad_() for _ in range(3))
    go = torch.ones(1, 2, L, 16).bfloat16()
    a = _mask((L, S), 3, L, S)
    keep = a.clone()
    first = _bf16_step(q, k, v, a, go)
    a.fill_(True)  # the user's tensor now holds another mask
    again = _bf16_step(q, k, v, keep, go)  # the first content, from another tensor
    for x, y in zip(first, again, strict=True):
        assert torch.equal(x, y)
    _bf16_close(_bf16_step(q, k, v, a, go), _bf16_want(q, k, v, a, go), 16, S, "all True")


def test_fp32_and_no_gradient_calls_are_not_replayed_by_content(monkeypatch):
    """Only a decision the mask's values do not enter is replayed by content: fp32 (its route reads the mask's tiles),
    bf16 without gradients, and bf16 with gradients where this machine's table measured torch's bf16 backward
    faster (SDPA's choice then reads the tiles) keep the full path (None from the kernel's replay)."""
    require_kernel()
    from attnkit import _calibrate

    mask = _mask((64, 64), 1, 64, 64)

    def request(dt, grad):  # (as the full path leaves it: the kernel's tile map in its memo)
        q, k, v = (torch.randn(1, 2, 64, 16).to(dt).requires_grad_(grad) for _ in range(3))
        req = attnkit._request.make_request(q, k, v, mask=mask, causal=False, scale=None, score_mod=None,
                                            dropout_p=0.0, return_lse=False, backend="tiled")
        assert not native.NATIVE.not_supported(req)
        return req

    for dt, grad in ((torch.float32, True), (torch.bfloat16, False)):
        assert native.NATIVE.replay(request(dt, grad), mask) is None, (dt, grad)
    assert native.NATIVE.replay(request(torch.bfloat16, True), mask) is not None
    table = _calibrate.Crossovers(bf16_grad="torch", source="calibrated 2026-11-29 on X")
    monkeypatch.setattr(_calibrate, "crossovers", lambda threads=None: table)
    assert native.NATIVE.replay(request(torch.bfloat16, True), mask) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_under_torch_compile_a_bool_tensor_mask_gives_the_eager_answer(dtype):
    """Inside ``torch.compile`` (fullgraph) the call runs attnkit's op with the mask as an input: the same output and
    gradients as the eager call, bit for bit, on the kernel's route — and after the mask is edited in place, the
    edited mask's."""
    require_kernel()
    L, S = 100, 130
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(L, S, generator=g) < 0.6
    mask[:, :3] = True
    mask[:, 64:] = False  # an empty key tile
    q, k, v = (torch.randn(1, 2, n, 32, generator=g).to(dtype).requires_grad_() for n in (L, S, S))

    def fn(q, k, v, m):
        return attnkit.attention(q, k, v, mask=m)

    assert attnkit.dispatch(q, k, v, mask=mask).worker == "native"
    cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for step in range(2):
        got = cf(q, k, v, mask)
        want = fn(q, k, v, mask)
        assert torch.equal(got, want), step
        for a, b in zip(torch.autograd.grad(got.float().sum(), (q, k, v)),
                        torch.autograd.grad(want.float().sum(), (q, k, v)), strict=True):
            assert torch.equal(a, b), step
        mask[5] = ~mask[5]  # edited in place: the next call reads it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_nonfinite_query_row_reaches_no_hidden_key_in_the_gradients(dtype, value, widened_bf16):
    """A query row with an inf or NaN (its weights NaN at every key): the kernel's backward on a tile map gives the
    NaN of the formula (autograd through ``where(mask, s, -inf)`` in float64) and no more — at a key the mask hides
    from that row, dK is NaN only in the dimension 0 · inf reaches, dV is the row's NaN weights' (the widening
    path: bf16 products off, as on a CPU without them)."""
    require_kernel()
    L = S = 130
    g = torch.Generator().manual_seed(2)
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    dense = ((i // 8 + j // 8) % 2 == 0) | (i == j)  # not intervals: partial tiles with their own bits
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (L, S, S))
    q[0, 0, 3, 5] = value
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attnkit.attention(q2, k2, v2, mask=dense, backend="eager").sum(), (q2, k2, v2))
    # the bool tensor, and the same mask as a user's mask_mod (its tile map evaluated from the mod)
    for mask in (dense, lambda b, h, qi, ki: ((qi // 8 + ki // 8) % 2 == 0) | (qi == ki)):
        assert attnkit.dispatch(q, k, v, mask=mask, backend="tiled").worker == "native"
        got = torch.autograd.grad(attnkit.attention(q, k, v, mask=mask, backend="tiled").float().sum(), (q, k, v))
        for name, a, b in zip("qkv", got, want, strict=True):
            assert torch.equal(a.isnan(), b.isnan()), (type(mask).__name__, name)
