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
from conftest import EPS, assert_close, budget, full_path, golden, require_kernel

import attnkit
from attnkit import _fast
from attnkit.backends import _native, _tilebits, native

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


def test_which_calls_are_replayed_and_how(monkeypatch):
    """fp32 with gradients keeps the full path (its route reads the mask's tiles; None from the kernel's replay);
    a call without gradients, fp32 or bf16, is replayed reading each call's mask in C (:func:`_replay_dense_forward`,
    tested below); bf16 with gradients by the mask's content, except where this machine's table measured torch's
    bf16 backward faster (SDPA's choice then reads the tiles)."""
    require_kernel()
    from attnkit import _calibrate

    mask = _mask((64, 64), 1, 64, 64)

    def request(dt, grad):  # (as the full path leaves it: the kernel's tile map in its memo)
        q, k, v = (torch.randn(1, 2, 64, 16).to(dt).requires_grad_(grad) for _ in range(3))
        req = attnkit._request.make_request(q, k, v, mask=mask, causal=False, scale=None, score_mod=None,
                                            dropout_p=0.0, return_lse=False, backend="tiled")
        assert not native.NATIVE.not_supported(req)
        return req

    assert native.NATIVE.replay(request(torch.float32, True), mask) is None
    for dt in (torch.float32, torch.bfloat16):
        run = native.NATIVE.replay(request(dt, False), mask)
        assert run is not None and run.__qualname__.startswith("_replay_dense_forward"), dt
    assert native.NATIVE.replay(request(torch.bfloat16, True), mask) is not None
    table = _calibrate.Crossovers(bf16_grad="torch", source="calibrated 2026-11-29 on X")
    monkeypatch.setattr(_calibrate, "crossovers", lambda threads=None: table)
    assert native.NATIVE.replay(request(torch.bfloat16, True), mask) is None


def _require_c_passes():
    """The kernel's C passes over a bool mask (``ak_dense_tiles``, ``ak_tile_rows``) are built with it, in the same
    library: a kernel without them is a stale build, not a configuration to skip."""
    assert _native.dense_tiles_fn() is not None and _native.tile_rows_fn() is not None, (
        "the compiled kernel lacks its C passes over a bool mask: a stale build; rebuild it (`make test` does)")


def _torch_tiles(dense, L, S, monkeypatch):
    """``dense_bits`` by torch ops (the path of a build without the C pass)."""
    with monkeypatch.context() as mp:
        mp.setattr(_native, "dense_tiles_fn", lambda: None)
        return _tilebits.dense_bits(dense, L, S)


@pytest.mark.parametrize("L,S", [(1, 1), (5, 7), (64, 64), (65, 64), (64, 65), (130, 200), (1, 300), (200, 1)])
def test_the_c_pass_reads_the_tile_map_torch_reads(L, S, monkeypatch):
    """The kernel's C pass over a bool mask's bytes (``ak_dense_tiles``) gives the tile map torch's ops give — kinds,
    partial tiles' order and bits — for every broadcast shape (a size-1 row or key dim, batch or head of 1), views
    with other strides (transposed, expanded, a slice of a bigger mask), ragged edges, and masks empty, full, random
    and banded; unpacked, the map is the mask."""
    require_kernel()
    _require_c_passes()
    g = torch.Generator().manual_seed(L * 1000 + S)
    B, H = 2, 3
    shapes = [(1, 1, L, S), (B, 1, L, S), (1, H, L, S), (B, H, 1, S), (B, 1, L, 1), (1, 1, 1, 1)]
    for shape in shapes:
        i, j = torch.arange(shape[2])[:, None], torch.arange(shape[3])[None, :]
        band = ((j - i).abs() < 20).expand(shape).clone()
        for name, m in (("empty", torch.zeros(shape, dtype=torch.bool)), ("full", torch.ones(shape, dtype=torch.bool)),
                        ("random", torch.rand(shape, generator=g) < 0.5),
                        ("mostly", torch.rand(shape, generator=g) < 0.97), ("band", band)):
            views = {"contiguous": m, "transposed": m.transpose(2, 3).contiguous().transpose(2, 3),
                     "a slice": torch.cat([m, ~m], dim=3)[..., : shape[3]],
                     "expanded": m[:, :1].expand(shape) if shape[1] > 1 else m}
            for how, x in views.items():
                got, want = _tilebits.dense_bits(x, L, S), _torch_tiles(x, L, S, monkeypatch)
                what = (shape, name, how)
                assert torch.equal(got.kinds, want.kinds) and torch.equal(got.index, want.index), what
                assert got.bits.shape == want.bits.shape, what
                assert torch.equal(_tilebits.unpack(got, B, H, L, S), x.expand(B, H, L, S)), what


@pytest.mark.parametrize("L,S", [(1, 1), (5, 7), (64, 64), (65, 64), (130, 200), (1, 300), (200, 1), (300, 300)])
def test_the_c_pass_reads_the_row_intervals_torch_reads(L, S, monkeypatch):
    """A tile map's row intervals read in C (``ak_tile_rows``) are torch's: the same (lo, hi) where every row sees one
    stretch of keys (a band, causal documents, a key prefix, rows that see nothing: 0, 0), None where a row sees two
    (attention sinks and a window, a random mask), for one batch row or two, rows broadcast or not."""
    require_kernel()
    _require_c_passes()
    g = torch.Generator().manual_seed(L + 7 * S)
    stretches = 0
    for shape in [(1, 1, L, S), (2, 1, L, S), (2, 1, 1, S), (2, 1, L, 1)]:
        i, j = torch.arange(shape[2])[:, None], torch.arange(shape[3])[None, :]
        for name, m in {"band": (j - i).abs() < 20, "documents": (i // 50 == j // 50) & (j <= i),
                        "prefix": j < S // 2, "nothing": torch.zeros(1, 1, dtype=torch.bool),
                        "sinks + window": (j < 4) | ((j <= i) & (j > i - 30)),
                        "random": torch.rand(shape, generator=g) < 0.5}.items():
            tb = _tilebits.dense_bits(m.expand(shape).clone(), L, S)
            got = _tilebits._row_intervals(tb, L, S)
            with monkeypatch.context() as mp:
                mp.setattr(_native, "tile_rows_fn", lambda: None)
                want = _tilebits._row_intervals(tb, L, S)
            assert (got is None) == (want is None), (shape, name)
            if got is not None:
                stretches += 1
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (shape, name)
    assert stretches >= 12  # (band, documents, prefix and nothing at every shape)


def test_the_c_pass_makes_room_for_more_partial_tiles_than_its_first_guess():
    """Past ``_ROOM_ALL_TILES`` tiles the first try has room for a quarter of them: a mask with every tile partial
    is read again with room for all (the map still the mask's)."""
    require_kernel()
    _require_c_passes()
    L, S = 64 * 65, 64 * 64  # 4160 tiles, more than 4096
    m = torch.rand(1, 1, L, S, generator=torch.Generator().manual_seed(2)) < 0.5
    tb = _tilebits.dense_bits(m, L, S)
    assert tb.partial_tiles == 65 * 64 and bool((tb.kinds == 1).all())
    assert torch.equal(_tilebits.unpack(tb, 1, 1, L, S), m)


def _fast_run(q, k, v, mask):
    """The fast path's prepared call for this signature (after a first call), or None."""
    key = _fast._signature(q, k, v, mask, False, None)
    return _fast._REPLAY.get(key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L,S", [(64, 64), (40, 64), (150, 200)])
def test_a_replayed_call_without_gradients_reads_each_calls_mask(dtype, L, S):
    """``auto``'s call without gradients with a bool tensor mask on the kernel is replayed: every call reads *its own*
    mask's tiles (the C pass into the prepared record's tile map) — the same tensor edited in place (rows emptied, a
    row of one key, all True, all False), then other tensors — each answer within the budget of float64 on that
    call's mask, rows that see no key 0, never NaN."""
    require_kernel()
    _fast.clear()
    B, H, D = 2, 2, 32
    g = torch.Generator().manual_seed(L + S)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (L, S, S))
    mask = _mask((B, 1, L, S), 4, L, S)
    if L > 64:  # tiles of every kind, so the route keeps it on the kernel whatever the edits below do
        mask[..., 64:128, 64:128] = True
        mask[..., :64, 128:] = False
    assert attnkit.dispatch(q, k, v, mask=mask).worker == "native"

    def check(m, what):
        out = attnkit.attention(q, k, v, mask=m)
        ref, lse = golden(q, k, v, mask=m)
        assert out.dtype is dtype and not out.isnan().any(), what
        # the bits of the full path's kernel call for this mask (on its row intervals where every row is one stretch)
        assert torch.equal(out, attnkit.attention(q, k, v, mask=m, backend="tiled")), what
        tol = budget(torch.float32, D, S)
        if dtype is torch.bfloat16:  # + P rounded to bf16 on AMX tiles (half a unit of each weight), and the output
            tol = tol + 2.0 ** -9 * v.double().abs().max() + 2.0 ** -8 * ref.abs()  # rounded (test_native_amx.py)
        assert ((out.double() - ref).abs() <= tol).all(), (what, (out.double() - ref).abs().max().item())
        assert (out[~torch.isfinite(lse)] == 0).all(), what

    check(mask, "first call")
    run = _fast_run(q, k, v, mask)
    assert run is not None and run.__qualname__.startswith("_replay_dense_forward"), run
    check(mask, "replayed")
    mask[0, :, 10:30] = False  # edited in place: rows that now see nothing
    check(mask, "rows emptied")
    mask[1, :, :, :] = False
    mask[1, :, 7, 3] = True  # one batch row: a single key in one row, nothing elsewhere
    check(mask, "one key")
    for fill in (True, False):
        mask.fill_(fill)
        check(mask, f"all {fill}")
    for seed in range(3):
        check(_mask((B, 1, L, S), 20 + seed, L, S), f"another tensor {seed}")
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    check(((j <= i + 3) & (j > i - 40)).expand(B, 1, L, S).clone(), "every row one stretch (on its intervals)")
    check(((j < 3) | (j > i + 2)).expand(B, 1, L, S).clone(), "two stretches a row (on the tile map)")
    assert _fast_run(q, k, v, mask) is run  # every call above replayed the one prepared call


@pytest.mark.parametrize("shape", [(64, 64), (1, 64, 64), (130,), (1, 1, 130)], ids=str)
def test_a_replayed_call_reads_a_mask_of_any_rank_as_the_api_broadcasts_it(shape):
    """The replayed call reads the user's tensor as it is, its missing leading dims of size 1 (no reshape per call):
    a (L, S) / (1, L, S) tile, and a key row (S,) / (1, 1, S) broadcast over 64 query rows, edited in place between
    calls — each answer the full path's, bit for bit (the kernel's, or SDPA's where every tile of the key row is
    partial: the route's), and within the fp32 budget of float64."""
    require_kernel()
    _fast.clear()
    L, S = 64, shape[-1]
    g = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g) for n in (L, S, S))
    mask = torch.rand(shape, generator=g) < 0.6
    if S > 64:
        mask[..., 64:128] = True  # a full tile, so the route keeps the first call on the kernel
    for step in range(4):
        out = attnkit.attention(q, k, v, mask=mask)
        backend = "tiled" if attnkit.dispatch(q, k, v, mask=mask).worker == "native" else "sdpa"
        assert torch.equal(out, attnkit.attention(q, k, v, mask=mask, backend=backend)), (step, backend)
        assert_close(out, golden(q, k, v, mask=mask)[0], budget(torch.float32, 32, S), f"step {step}")
        if step:
            run = _fast_run(q, k, v, mask)
            assert run is not None and run.__qualname__.startswith("_replay_dense_forward")
        mask.copy_(torch.rand(shape, generator=g) < 0.3 * step)  # edited in place (the last: empty, rows that die)


@pytest.mark.parametrize("score", ["alibi", "learned alibi", "soft cap", "a table"])
@pytest.mark.parametrize("L,S", [(128, 128), (40, 64)])
def test_a_replayed_call_with_a_score_mod_keeps_it(score, L, S):
    """A bool tensor mask and a score_mod without gradients (SDPA cannot take a score_mod: the kernel does): the
    replayed call adds ALiBi's bias (fixed slopes: the kernel's own bias; learned slopes under no_grad: the same) or
    runs the score_mod's program (a soft cap, a table read by index) at every call, the mask edited in place between
    calls — each answer the full path's bits and within the fp32 budget of float64 (the replay once dropped ALiBi's
    fixed slopes: the answer without the bias)."""
    require_kernel()
    from attnkit import score_mods

    _fast.clear()
    H, D = 2, 32
    g = torch.Generator().manual_seed(L + S)
    q, k, v = (torch.randn(1, H, n, D, generator=g) for n in (L, S, S))
    if score == "alibi":
        sm = score_mods.alibi(torch.tensor([0.5, 0.25]))
    elif score == "learned alibi":
        sm = score_mods.alibi(torch.tensor([0.5, 0.25]).requires_grad_())
    elif score == "soft cap":
        sm = score_mods.softcap(5.0)
    else:
        table = torch.randn(S, generator=g)

        def sm(s, b, h, qi, kv):
            return s + table[kv]
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    mask[3, 5] = False  # (rows of two stretches: the tile map; edited below into one stretch a row)
    with torch.no_grad():
        assert attnkit.dispatch(q, k, v, mask=mask, score_mod=sm).worker == "native"
        for step in range(3):
            out = attnkit.attention(q, k, v, mask=mask, score_mod=sm)
            assert torch.equal(out, full_path(q, k, v, mask=mask, score_mod=sm)), (score, step)
            assert_close(out, golden(q, k, v, mask=mask, score_mod=sm)[0], budget(torch.float32, D, S),
                         f"{score} step {step}")
            if step and score != "learned alibi":  # (learned slopes: no content key, never replayed)
                run = _fast_run_mod(q, k, v, mask, sm)
                assert run is not None and run.__qualname__.startswith("_replay_dense_forward"), run
            mask[3, 5] = step == 0  # edited in place
            mask[L - 1, :7] = step == 1


def _fast_run_mod(q, k, v, mask, sm):
    """The fast path's prepared call for a signature with a score_mod (after a first call), or None."""
    key = _fast._signature(q, k, v, mask, False, None, sm)
    return None if key is None else _fast._REPLAY.get(key)


def test_a_replayed_call_whose_mask_becomes_all_partial_takes_the_full_path():
    """Above one tile the route reads the mask's values (almost every tile partial: SDPA): a replayed call checks
    each call's share of partial tiles and hands one past the bar to the full path, which sends it to SDPA."""
    require_kernel()
    _fast.clear()
    L = S = 192
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g) for n in (L, S, S))
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    band = (j - i).abs() <= 70
    band[:, 0] = True
    mask = band.clone()
    mask[5, 100] = True  # (not one stretch a row: the kernel runs its tile map)
    assert attnkit.dispatch(q, k, v, mask=mask).worker == "native"
    attnkit.attention(q, k, v, mask=mask)
    run = _fast_run(q, k, v, mask)
    assert run is not None and run(q, k, v, mask, None) is not None
    mask.copy_(torch.rand(L, S, generator=g) < 0.5)
    mask[:, 0] = True
    assert attnkit.dispatch(q, k, v, mask=mask).backend == "sdpa"
    assert run(q, k, v, mask, None) is None  # this call's mask: past the bar, the full path's
    out = attnkit.attention(q, k, v, mask=mask)
    ref, _ = golden(q, k, v, mask=mask)
    assert_close(out, ref, budget(torch.float32, 32, S), "all partial")


def test_a_replayed_call_from_two_threads_reads_each_threads_mask():
    """The prepared call keeps its tile buffers per thread: two threads replaying one signature with different masks
    at once each get their own mask's answer."""
    require_kernel()
    import threading

    _fast.clear()
    L = S = 64
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, n, 32, generator=g) for n in (L, S, S))
    ms = [_mask((L, S), 30 + t, L, S) for t in range(2)]
    refs = [golden(q, k, v, mask=m)[0] for m in ms]
    attnkit.attention(q, k, v, mask=ms[0])  # learned
    errors = []

    def work(t):
        try:
            for _ in range(200):
                out = attnkit.attention(q, k, v, mask=ms[t])
                err = (out.double() - refs[t]).abs().max().item()
                if err > budget(torch.float32, 32, S):
                    errors.append((t, err))
                    return
        except Exception as e:  # (reported below)
            errors.append((t, repr(e)))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_a_bool_mask_of_one_tile_goes_where_the_table_says(monkeypatch):
    """A bool mask of one 64 x 64 tile without gradients: the kernel by today's rule; SDPA where this machine's
    calibration measured SDPA faster (``small_mask``), or the call wants gradients."""
    require_kernel()
    from attnkit import _calibrate

    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    m = _mask((64, 64), 2, 64, 64)
    d = attnkit.dispatch(q, k, v, mask=m)
    assert d.worker == "native" and "one 64 x 64 tile" in d.reason and "C pass" in d.reason
    assert attnkit.dispatch(q.requires_grad_(), k, v, mask=m).backend == "sdpa"
    q.requires_grad_(False)
    table = _calibrate.Crossovers(small_mask="torch", source="calibrated 2026-11-29 on X")
    monkeypatch.setattr(_calibrate, "crossovers", lambda threads=None: table)
    d = attnkit.dispatch(q, k, v, mask=m)
    assert (d.backend, d.worker) == ("sdpa", "fused") and "one 64 x 64 tile" in d.reason


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
