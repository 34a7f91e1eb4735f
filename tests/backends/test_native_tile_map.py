"""Any mask on attnkit's compiled kernel: the plan's tile map, each partial tile masked by its own bits.

FlashMask's twelve families written as users' ``mask_mod``s (``_flashmask.py``), ``|`` / ``~``
combinations, random key padding, repeated document ids and per-head mods run on the kernel
(``dispatch`` says "tile map"), and match the float64 golden: output, lse (-inf exactly on rows that
see nothing) and the gradients of q, k, v — on every instruction set, with GQA, L != S, both causal
alignments. The tile map itself is checked against the dense mask, and its cache against in-place edits.
"""

from __future__ import annotations

import os

import pytest
import torch
from _flashmask import NAMES, families
from conftest import rand_qkv
from test_native_kernel import _check, instruction_set

import attnkit
from attnkit import masks as M
from attnkit.backends import _tilebits, tiled

pytestmark = pytest.mark.skipif(os.environ.get("ATTNKIT_NATIVE", "1").lower() in ("0", "off", "false", "no"),
                                reason="the compiled kernel is switched off by ATTNKIT_NATIVE=0")

SIZES = [(1, 1), (130, 130), (77, 200)]


def _on_tile_map(q, k, v, mask):
    d = attnkit.dispatch(q, k, v, mask=mask, backend="tiled")
    assert d.worker == "native" and "tile map" in d.worker_reason, d


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("L,S", SIZES, ids=[f"L{L}_S{S}" for L, S in SIZES])
def test_flashmask_family_as_a_mask_mod_matches_float64(name, L, S):
    n = max(L, S)
    mod, _ = families(n, H=4, seed=L * 7 + S)[name]
    q, k, v = rand_qkv(2, 4, 2, L, S, 24, 40, requires_grad=True)
    mask = M.from_mod(mod)
    if name not in ("full",):  # full / causal-like mods whose every row is one stretch may go by intervals
        d = attnkit.dispatch(q, k, v, mask=mask, backend="tiled")
        assert d.worker == "native", d
    _check(q, k, v, mask, lse_grad=True)


@pytest.mark.parametrize("name", NAMES)
def test_tile_map_equals_the_dense_mask(name):
    L = S = 300
    mod, _ = families(L, H=3, seed=5)[name]
    mask = M.from_mod(mod)
    tb = _tilebits.tile_bits(mask, 2, 3, L, S)
    assert torch.equal(_tilebits.unpack(tb, 2, 3, L, S), mask.materialize(2, 3, L, S))


def test_combinations_padding_documents_and_heads():
    """|, ~, random key padding, repeated document ids, a mod that differs per head and per batch row."""
    B, H, L, S = 2, 4, 150, 150
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3, (S,), generator=g)  # repeated, out of order
    pad = torch.rand(B, S, generator=g) > 0.3
    per_bh = torch.randint(0, S, (B, H), generator=g)
    masks = [
        M.sliding_window(20) | M.causal("top_left"),
        ~M.sliding_window(30),
        ~M.causal() & M.prefix_lm(40),
        M.key_padding(pad),
        M.document(ids),
        M.document(ids) & M.causal(),
        M.from_mod(lambda b, h, q, kv: (kv <= q) & (kv != per_bh[b, h])),
        M.from_mod(lambda b, h, q, kv: ((q + kv + h) % 3 == 0) | (kv == 0)),
    ]
    for mask in masks:
        q, k, v = rand_qkv(B, H, 2, L, S, 32, requires_grad=True)
        _on_tile_map(q, k, v, mask)
        _check(q, k, v, mask, lse_grad=True)


def test_both_causal_alignments_and_dead_rows():
    """L > S bottom-right: the first rows see nothing; a mod that kills whole rows and whole tiles."""
    for L, S in [(200, 90), (90, 200)]:
        for align in ("bottom_right", "top_left"):
            mask = M.causal(align) & M.from_mod(lambda b, h, q, kv: (q % 5 != 1) & (kv % 7 != 3))
            q, k, v = rand_qkv(1, 2, 1, L, S, 16, requires_grad=True)
            _on_tile_map(q, k, v, mask)
            _check(q, k, v, mask, lse_grad=True)
    dead = M.from_mod(lambda b, h, q, kv: (q < 64) & (kv >= 0))  # whole query blocks see nothing
    q, k, v = rand_qkv(1, 2, 2, 200, 100, 16, requires_grad=True)
    _on_tile_map(q, k, v, dead)
    _check(q, k, v, dead)


@pytest.mark.parametrize("isa", ["base", "avx2", "avx512"])
def test_every_instruction_set(isa):
    with instruction_set(isa):
        for name in ("share_question", "random_eviction", "qk_sparse"):
            mod, _ = families(260, H=4, seed=1)[name]
            q, k, v = rand_qkv(2, 4, 2, 260, 200, 24, 40, requires_grad=True)
            _check(q, k, v, M.from_mod(mod), lse_grad=True)


def test_a_mod_reading_a_tensor_is_never_stale():
    """The map of a mod that reads a tensor is built afresh each call: editing the tensor in place changes
    the answer exactly as the reference says (no cache keyed by the function's identity)."""
    ids = torch.tensor([0] * 70 + [1] * 60)
    mask = M.from_mod(lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv))
    q, k, v = rand_qkv(1, 2, 2, 130, 130, 16, requires_grad=True)
    _check(q, k, v, mask)
    ids[40:] = 2  # the next packed batch
    _check(q, k, v, mask)


def test_built_in_masks_keep_their_intervals():
    q, k, v = rand_qkv(1, 2, 2, 130, 130, 16)
    for mask in (M.causal(), M.sliding_window(20), M.document(torch.tensor([0] * 60 + [1] * 70)), None):
        d = attnkit.dispatch(q, k, v, mask=mask, backend="tiled")
        assert d.worker == "native" and "row intervals" in d.worker_reason, d


def test_a_mod_that_cannot_run_on_stacked_tiles_stays_exact_elsewhere():
    """A mod whose Python branches on a scalar index cannot be evaluated on stacked tiles: the call goes
    to torch's kernels, says why, and is exact."""
    def scalar_only(b, h, q, kv):
        if q.numel() != 1:
            raise RuntimeError("one point at a time")
        return q >= kv

    q, k, v = rand_qkv(1, 2, 2, 70, 70, 16)
    d = attnkit.dispatch(q, k, v, mask=M.from_mod(scalar_only), backend="tiled")
    assert d.worker == "native" or "stacked" in d.worker_reason, d


def test_kernel_off_the_families_stay_exact(monkeypatch):
    monkeypatch.setattr(tiled, "NATIVE", False)
    for name in ("share_question", "random_eviction"):
        mod, _ = families(130, H=2, seed=2)[name]
        q, k, v = rand_qkv(1, 2, 1, 130, 130, 16)
        mask = M.from_mod(mod)
        d = attnkit.dispatch(q, k, v, mask=mask, backend="tiled")
        assert d.worker != "native", d
        from conftest import assert_close, budget, golden
        ref, _ = golden(q, k, v, mask=mask)
        assert_close(attnkit.attention(q, k, v, mask=mask, backend="tiled"), ref, budget(torch.float32, 16, 130))


@pytest.mark.parametrize("block", [(64, 64), (128, 128), (128, 64)])
def test_explicit_plans_and_block_masks_run_on_the_kernel(block):
    """A plan's tiles are run as given (a BlockMask's semantics), cut into 64 x 64, the mask evaluated in the
    partial ones; causal=True on top intersects. flex_attention with a BlockMask takes the same path."""
    mod, _ = families(300, H=4, seed=9)["share_question"]
    mask = M.from_mod(mod)
    plan = attnkit.plan(mask, L=300, S=300, B=2, H=4, block=block)
    q, k, v = rand_qkv(2, 4, 2, 300, 300, 32, requires_grad=True)
    for causal in (False, True):
        d = attnkit.dispatch(q, k, v, mask=plan, causal=causal, backend="tiled")
        assert d.worker == "native" and "tile map" in d.worker_reason, d
        if not causal:
            _check(q, k, v, plan, lse_grad=True)
    from conftest import assert_close, budget, golden
    out = attnkit.attention(q, k, v, mask=plan, causal=True, backend="tiled")
    ref, _ = golden(q, k, v, mask=mask & M.causal())
    assert_close(out, ref, budget(torch.float32, 32, 300), "plan & causal")
    bm = attnkit.create_block_mask(mod, 2, 4, 300, 300)
    qf, kf, vf = rand_qkv(2, 4, 4, 300, 300, 32)
    assert "tile map" in attnkit.dispatch(qf, kf, vf, mask=bm, backend="tiled").worker_reason
    assert_close(attnkit.flex_attention(qf, kf, vf, block_mask=bm), golden(qf, kf, vf, mask=mask)[0],
                 budget(torch.float32, 32, 300), "flex_attention")


def test_a_block_mask_of_a_mod_that_ignores_batch_and_head_runs_on_the_kernel():
    """A BlockMask with many partial tiles whose mod reads only q_idx / kv_idx (and one that only vmap reads:
    chained indexing) is evaluated on the kernel's stacked tiles, not refused for the (b, h, q, kv) grid's shape
    (it fell back to torch's kernels before)."""
    from conftest import assert_close, budget, golden

    def checker(b, h, q_idx, kv_idx):
        return ((q_idx // 8 + kv_idx // 8) % 2 == 0) | (q_idx == kv_idx)

    table = torch.rand(2, 300) > 0.3

    def chained(b, h, q_idx, kv_idx):
        return table[b][kv_idx] | (q_idx == kv_idx)

    for mod in (checker, chained):
        bm = attnkit.create_block_mask(mod, 2, None, 300, 300)
        q, k, v = rand_qkv(2, 4, 2, 300, 300, 32, requires_grad=True)
        _on_tile_map(q, k, v, bm)
        _check(q, k, v, bm, lse_grad=True)
        assert_close(attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True),
                     golden(q, k, v, mask=M.from_mod(mod))[0], budget(torch.float32, 32, 300), mod.__name__)


def _dense(mod, B, H, L, S):
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    return M.from_mod(mod).bind(L, S)(b, h, torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S))


@pytest.mark.parametrize("L,S", [(256, 256), (130, 200), (200, 70), (1, 65)])
def test_row_intervals_read_off_a_tile_map_equal_the_dense_mask(L, S):
    """Where every row of a mod's tile map sees one stretch of keys, ``row_intervals`` gives exactly that stretch
    (``lo = hi = 0`` for a row that sees nothing); anything else (holes, heads that differ) gives None."""
    ids = torch.arange(max(L, S)) * 5 // max(L, S)
    lengths = torch.tensor([S, S // 3])
    interval_mods = {
        "window": lambda b, h, q, kv: (kv <= q) & (q - kv < 40),
        "causal_documents": lambda b, h, q, kv: (ids[q] == ids[kv]) & (kv <= q),
        "prefix_lm": lambda b, h, q, kv: (kv < 70) | (kv <= q),
        "padding_by_batch": lambda b, h, q, kv: kv < lengths[b],
        "dead_rows": lambda b, h, q, kv: (q >= 100) & (kv < q - 99),
    }
    other_mods = {
        "checkerboard": lambda b, h, q, kv: ((q // 8 + kv // 8) % 2 == 0) | (q == kv),
        "per_head": lambda b, h, q, kv: kv <= q + h,
    }
    B, H = 2, 3
    for name, mod in {**interval_mods, **other_mods}.items():
        dense = _dense(mod, B, H, L, S).expand(B, H, L, S)
        tb = _tilebits.tile_bits(M.from_mod(mod), B, H, L, S)
        got = _tilebits.row_intervals(tb, L, S)
        keys = torch.arange(S)
        rows_are_stretches = all(
            bool((dense[b, h, i] == ((keys >= dense[b, h, i].int().argmax()) & (keys <= S - 1 - dense[b, h, i].flip(0)
                                                                              .int().argmax()))).all())
            or not bool(dense[b, h, i].any())
            for b in range(B) for h in range(H) for i in range(L))
        same_heads = bool((dense == dense[:, :1]).all())
        if name in other_mods and not (rows_are_stretches and same_heads):
            assert got is None, name
            continue
        assert got is not None, name
        lo, hi = got
        assert lo.dtype == hi.dtype == torch.int32 and lo.shape[1] == L and lo.shape[0] in (1, B), (name, lo.shape)
        want = (keys >= lo.long().unsqueeze(-1)) & (keys < hi.long().unsqueeze(-1))  # (TB, L, S)
        assert torch.equal(want.unsqueeze(1).expand(B, H, L, S), dense), name


def test_a_block_mask_of_interval_rows_runs_on_intervals_and_matches_float64():
    """A BlockMask of a window mod (FlexAttention code switched by one import) runs the kernel on row intervals
    read off its tile map, forward and backward equal to the float64 golden."""
    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 100)

    bm = attnkit.create_block_mask(window, 2, None, 300, 300)
    q, k, v = rand_qkv(2, 4, 2, 300, 300, 32, requires_grad=True)
    d = attnkit.dispatch(q, k, v, mask=bm, backend="tiled")
    assert d.worker == "native" and "row intervals (read off its tile map" in d.worker_reason, d
    _check(q, k, v, bm, lse_grad=True)


def test_a_block_mask_whose_mod_reads_ids_edited_in_place_is_never_stale():
    """A BlockMask's tile map (and the intervals read off it) is cached by content: the mod's captured ids are
    digested on every call, so ids edited in place between calls give the new mask's result, not the cached one."""
    from conftest import assert_close, budget, golden
    ids = torch.arange(300) * 3 // 300

    def docs(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

    bm = attnkit.create_block_mask(docs, 1, None, 300, 300)
    q, k, v = rand_qkv(1, 4, 4, 300, 300, 32)
    first = attnkit.flex_attention(q, k, v, block_mask=bm)
    assert_close(first, golden(q, k, v, mask=bm)[0], budget(torch.float32, 32, 300), "first")
    again = attnkit.flex_attention(q, k, v, block_mask=bm)  # the cached map / intervals
    assert torch.equal(first, again)
    ids[150:] += 1  # a new document boundary inside the block mask's partial blocks
    after = attnkit.flex_attention(q, k, v, block_mask=bm)
    assert not torch.equal(after, first)
    assert_close(after, golden(q, k, v, mask=bm)[0], budget(torch.float32, 32, 300), "after the edit")
