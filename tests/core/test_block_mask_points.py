"""A decode step's BlockMask is read as its points: attnkit.create_block_mask keeps the points it evaluated, a
BlockMask from elsewhere (torch's, a slice of a large one) gets them on its first call, and later calls read them
again — only while the block mask, its mod and what the mod reads are what they were.

Each case against the float64 golden of FlexAttention's meaning of the block mask (its full blocks, the mod in its
partial ones, nothing elsewhere), and against the same call read as a plan (points off: the way of larger calls).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import budget, golden

import attnkit
from attnkit import masks, plans
from attnkit._blockmask import block_mask_plan

B, H, HKV, D = 2, 8, 2, 16


def _inputs(L, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g), torch.randn(B, HKV, S, D, generator=g),
            torch.randn(B, HKV, S, D, generator=g))


def _blocks_golden(q, k, v, bm):
    """float64 golden of what FlexAttention's kernels make of ``bm``: full blocks whole, ``mask_mod`` inside the
    partial ones, every other block skipped (the blocks read off its kv_* fields, as they are now)."""
    L, S = bm.seq_lengths
    bq, bk = bm.BLOCK_SIZE
    allowed = torch.zeros(B, H, L, S, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            bb, hh = b % bm.kv_num_blocks.shape[0], h % bm.kv_num_blocks.shape[1]
            for i in range(L):
                qb = i // bq
                part = bm.kv_indices[bb, hh, qb, :bm.kv_num_blocks[bb, hh, qb]].tolist()
                full = bm.full_kv_indices[bb, hh, qb, :bm.full_kv_num_blocks[bb, hh, qb]].tolist()
                for j in range(S):
                    if j // bk in full:
                        allowed[b, h, i, j] = True
                    elif j // bk in part:
                        allowed[b, h, i, j] = bool(bm.mask_mod(torch.tensor(b), torch.tensor(h), torch.tensor(i),
                                                               torch.tensor(j)))
    g = H // HKV
    return golden(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), mask=allowed)[0]


def _check(q, k, v, bm, **kw):
    out = attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, **kw)
    ref = _blocks_golden(q, k, v, bm)
    assert (out.double() - ref).abs().max().item() <= budget(torch.float32, D, k.shape[2])
    with pytest.MonkeyPatch.context() as mp:  # the same block mask read as a plan
        mp.setattr(masks, "_SMALL_GRID_ROWS", 0)
        general = attnkit.flex_attention(q, k, v, block_mask=bm.to("cpu"), enable_gqa=True, **kw)
    assert (out - general).abs().max().item() <= budget(torch.float32, D, k.shape[2])
    return out


def _read(bm, L, S):
    return block_mask_plan(bm, B, H, L, S, torch.device("cpu"), "block_mask")


def _uses_points(bm, L, S) -> bool:
    """Whether the call reads the points kept on ``bm`` (not points read again from its blocks)."""
    rec = getattr(bm, "_attnkit_points", None)
    return rec is not None and _read(bm, L, S) is rec.tensor


@pytest.mark.parametrize("L, S, block", [(1, 300, 128), (1, 257, 64), (3, 200, 128), (16, 130, (16, 32))])
def test_a_decode_steps_block_mask_is_read_off_its_points_exactly(L, S, block):
    off = S - L
    mod = lambda b, h, qi, kv: (kv <= qi + off) & (kv > qi + off - 90) | (kv < 4)  # noqa: E731
    bm = attnkit.create_block_mask(mod, B, None, L, S, BLOCK_SIZE=block)
    assert _uses_points(bm, L, S)
    q, k, v = _inputs(L, S)
    _check(q, k, v, bm)


def test_per_head_and_per_batch_mods_keep_their_points():
    L, S = 1, 200
    lengths = torch.tensor([150, 37])
    mod = lambda b, h, qi, kv: (kv < lengths[b]) & (kv >= 8 * h)  # noqa: E731
    bm = attnkit.create_block_mask(mod, B, H, L, S)
    assert _uses_points(bm, L, S)
    q, k, v = _inputs(L, S, 1)
    _check(q, k, v, bm)


def test_an_in_place_edit_of_the_blocks_is_seen():
    """Blocks dropped from kv_* after the BlockMask was built: FlexAttention skips them, and so does attnkit
    (the points no longer describe the block mask)."""
    L, S = 1, 300
    mod = lambda b, h, qi, kv: kv <= qi + S - 1  # noqa: E731
    bm = attnkit.create_block_mask(mod, B, None, L, S, BLOCK_SIZE=64)
    q, k, v = _inputs(L, S, 2)
    before = _check(q, k, v, bm)
    # (L = 1: a ragged query block, so every block is partial: the padding rule)
    bm.kv_num_blocks[0, 0, 0] = 2  # batch row 0 keeps its first two blocks only
    assert not _uses_points(bm, L, S)  # (read again from the blocks, and kept: the next call reads those)
    assert _uses_points(bm, L, S)
    after = _check(q, k, v, bm)
    assert not torch.allclose(before[0], after[0]) and torch.equal(before[1], after[1])


def test_an_edit_through_numpy_is_seen():
    """The same edit made through ``.numpy()`` (which leaves torch's version counter as it was)."""
    L, S = 1, 300
    mod = lambda b, h, qi, kv: kv <= qi + S - 1  # noqa: E731
    bm = attnkit.create_block_mask(mod, B, None, L, S, BLOCK_SIZE=64)
    bm.kv_num_blocks.numpy()[1, 0, 0] = 3  # batch row 1 keeps its first three blocks only
    assert not _uses_points(bm, L, S)
    _check(*_inputs(L, S, 8), bm)


def test_a_field_or_mod_replaced_is_seen():
    L, S = 1, 300
    mod = lambda b, h, qi, kv: kv <= qi + S - 1  # noqa: E731
    q, k, v = _inputs(L, S, 3)
    bm = attnkit.create_block_mask(mod, B, None, L, S, BLOCK_SIZE=64)
    bm.kv_num_blocks = torch.full_like(bm.kv_num_blocks, 1)  # (a new tensor) its first block only
    assert not _uses_points(bm, L, S)
    _check(q, k, v, bm)
    bm = attnkit.create_block_mask(mod, B, None, L, S, BLOCK_SIZE=64)
    bm.mask_mod = lambda b, h, qi, kv: kv < 10  # (every block partial: this mod decides)
    assert not _uses_points(bm, L, S)
    _check(q, k, v, bm)


@pytest.mark.parametrize("L", [1, 16])
def test_the_data_a_mod_reads_edited_after_the_block_mask_is_seen(L):
    """A mod reading a tensor edited in place after create_block_mask: FlexAttention's kernels run the blocks as
    built and the mod as it now reads; the points (the old data) are not used. (L = 16 with query blocks of 16:
    blocks 1-3 full, attended whole whatever the mod now says there.)"""
    S = 300
    keep = torch.ones(S, dtype=torch.bool)
    keep[:40] = False
    mod = lambda b, h, qi, kv: keep[kv]  # noqa: E731
    bm = attnkit.create_block_mask(mod, B, None, L, S, BLOCK_SIZE=(16, 64))
    assert L == 1 or bm.full_kv_num_blocks[0, 0, 0] == 3
    assert _uses_points(bm, L, S)
    keep[100:110] = False  # the blocks as built, the mod as it now reads (in the partial blocks)
    assert not _uses_points(bm, L, S)
    q, k, v = _inputs(L, S, 4)
    _check(q, k, v, bm)


def test_a_mod_without_a_value_key_keeps_no_points():
    """A mod reading a list (data that may change unseen): no points kept, each call reads the blocks and the mod
    as they are then."""
    L, S = 1, 200
    box = [150]
    mod = lambda b, h, qi, kv: kv < box[0]  # noqa: E731
    bm = attnkit.create_block_mask(mod, B, None, L, S)
    assert getattr(bm, "_attnkit_points", None) is None
    q, k, v = _inputs(L, S, 5)
    _check(q, k, v, bm)
    assert getattr(bm, "_attnkit_points", None) is None
    box[0] = 60  # (inside the block mask's blocks: all partial at L = 1)
    _check(q, k, v, bm)


def test_a_sliced_block_mask_as_gpt_fast_builds_it_each_step():
    """One BlockMask for the whole cache, its row for the step sliced off (torch's ``__getitem__``), the mod offset
    by the step's position, the lengths set to (1, cache): read as its points on its first call, kept for the next
    layer's, exact at every step; torch's and attnkit's create_block_mask alike."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm

    MAX = 300
    q, k, v = _inputs(1, MAX, 9)
    causal = lambda b, h, qi, kv: qi >= kv  # noqa: E731
    for build in (attnkit.create_block_mask, torch_cbm):
        big = build(causal, 1, 1, MAX, MAX, BLOCK_SIZE=64)
        for pos in (0, 63, 64, 170, 299):
            m = big[:, :, pos // 64]
            m.mask_mod = lambda b, h, qi, kv, pos=pos: causal(b, h, qi + pos, kv)
            m.seq_lengths = (1, MAX)
            assert isinstance(_read(m, 1, MAX), torch.Tensor) and _uses_points(m, 1, MAX)
            out = _check(q, k, v, m)
            ref = golden(q, k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1),
                         mask=torch.arange(MAX) <= pos)[0]
            assert (out.double() - ref).abs().max().item() <= budget(torch.float32, D, MAX)


def test_copies_and_other_devices_and_sizes_go_the_general_way():
    L, S = 1, 200
    mod = lambda b, h, qi, kv: kv < 150  # noqa: E731
    bm = attnkit.create_block_mask(mod, B, None, L, S)
    rec = bm._attnkit_points
    assert rec.points(bm, B, H, L, S, torch.device("cpu")) is not None
    assert rec.points(bm, B, H, L, S, torch.device("meta")) is None  # (a GPU call: torch's kernels read the blocks)
    assert rec.points(bm, B, H, L, S + 1, torch.device("cpu")) is None
    assert rec.points(bm, 3, H, L, S, torch.device("cpu")) is None  # (the general way names the mismatch)
    copy = bm.to("cpu")
    assert getattr(copy, "_attnkit_points", None) is None  # (a copy: read from its blocks on its first call)
    assert isinstance(_read(copy, L, S), torch.Tensor) and _uses_points(copy, L, S)
    with pytest.raises(ValueError, match="B=2"):
        attnkit.flex_attention(*(t[:1].expand(3, -1, -1, -1) for t in _inputs(L, S)), block_mask=bm,
                               enable_gqa=True)


def test_dead_rows_give_zero_and_minus_inf_as_before():
    L, S = 2, 100
    mod = lambda b, h, qi, kv: (qi == 0) & (kv < 50)  # noqa: E731  (row 1 sees no key)
    bm = attnkit.create_block_mask(mod, B, None, L, S)
    assert _uses_points(bm, L, S)
    q, k, v = _inputs(L, S, 6)
    out, lse = attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.isneginf(lse[:, :, 1]).all() and torch.isfinite(lse[:, :, 0]).all()
    _check(q, k, v, bm)


def test_gradients_equal_the_general_ways():
    L, S = 3, 150
    mod = lambda b, h, qi, kv: (kv <= qi + S - L) & (kv % 7 != 3)  # noqa: E731
    bm = attnkit.create_block_mask(mod, B, None, L, S, BLOCK_SIZE=64)
    assert _uses_points(bm, L, S)
    grads = []
    for mask in (bm, bm.to("cpu")):
        q, k, v = (t.double().requires_grad_() for t in _inputs(L, S, 7))
        out = attnkit.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        out.square().sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(1, 1, 1, 9), (2, 3, 1, 5), (1, 2, 3, 4), (2, 1, 4, 1), (1, 1, 2, 7)])
@pytest.mark.parametrize("ragged", [(False, False), (True, False), (False, True), (True, True)])
def test_a_tiny_maps_fields_equal_the_numpy_paths(shape, ragged, monkeypatch):
    """The list-built fields of a tiny map (a decode step's) equal those of the NumPy / torch ordering, field for
    field, with the padding rule of a ragged last query / key block."""
    g = np.random.default_rng(sum(shape) + 2 * ragged[0] + ragged[1])
    kinds = torch.from_numpy(g.integers(0, 3, size=shape).astype(np.int8))
    bm_, bn_ = 4, 8
    L = shape[2] * bm_ - (1 if ragged[0] else 0)
    S = shape[3] * bn_ - (3 if ragged[1] else 0)
    tiny = plans._block_mask(kinds, (bm_, bn_), L, S, None)
    monkeypatch.setattr(plans, "_TINY_MAP", 0)
    ref = plans._block_mask(kinds, (bm_, bn_), L, S, None)
    for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        a, b = getattr(tiny, f), getattr(ref, f)
        assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape and torch.equal(a, b), f
        assert a.is_contiguous()


@pytest.mark.parametrize("lead", [(1, 1), (2, 3)])
@pytest.mark.parametrize("nq, rows, K, nk", [(1, 1, 9, 9), (2, 3, 5, 4), (3, 3, 7, 7)])
def test_a_tiny_block_lists_dense_map_equals_the_numpy_reading(lead, nq, rows, K, nk, monkeypatch):
    """kv_num_blocks / kv_indices read into a block map in lists (a decode step's ten entries) as NumPy reads them:
    the first ``num`` entries of each row, indices outside [0, nk) dropped, rows past nq ignored."""
    from attnkit import _blockmask

    g = np.random.default_rng(nq * 10 + K + lead[1])
    num = torch.from_numpy(g.integers(0, K + 2, size=(*lead, rows)).astype(np.int32))
    idx = torch.from_numpy(g.integers(-1, nk + 2, size=(*lead, rows, K)).astype(np.int32))
    tiny = _blockmask._dense_np(num, idx, nq, nk)
    monkeypatch.setattr(_blockmask, "_TINY_BLOCKS", -1)
    ref = _blockmask._dense_np(num, idx, nq, nk)
    assert tiny.shape == ref.shape == (*lead, nq, nk) and (tiny == ref).all()


def _flex_ref(q, k, v, allowed):
    g = q.shape[1] // k.shape[1]
    return golden(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), mask=allowed)[0]


def test_a_mod_reading_b_or_h_with_none_sizes_keeps_no_points():
    """B / H None with a mod that reads b / h: the blocks are those of batch row / head 0 (torch's), and the mod
    decides inside them with the call's own b / h — no points of one row stand for all (review finding)."""
    S = 1024
    lens = torch.tensor([1000, 990])
    per_head = (torch.arange(S) < 1000 - 7 * torch.arange(H)[:, None]).view(1, H, 1, S)
    for mod, allowed in ((lambda b, h, qi, kv: kv < lens[b], (torch.arange(S) < lens[:, None]).view(2, 1, 1, S)),
                         (lambda b, h, qi, kv: kv < 1000 - 7 * h, per_head)):
        bm = attnkit.create_block_mask(mod, None, None, 1, S)
        assert getattr(bm, "_attnkit_points", None) is None
        q, k, v = (t.repeat_interleave(1, 0) for t in _inputs(1, S, 10))
        out = attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
        assert (out.double() - _flex_ref(q, k, v, allowed)).abs().max().item() <= budget(torch.float32, D, S)


def test_points_of_one_call_size_are_not_reused_for_another():
    """A BlockMask (torch's, B / H None) called with B = 1, then B = 2, then H = 4 over its own mod reading b: each
    call exact, none refused (review finding: points of the first call's sizes were reused or refused)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm

    S = 300
    lens = torch.tensor([250, 200])
    mod = lambda b, h, qi, kv: kv < lens[b]  # noqa: E731
    bm = torch_cbm(mod, None, None, 4, S, device="cpu")
    g = torch.Generator().manual_seed(11)
    for Bc, Hc in ((1, 2), (2, 2), (1, 4), (2, 4)):
        q, k, v = (torch.randn(Bc, Hc, n, 16, generator=g) for n in (4, S, S))
        out = attnkit.flex_attention(q, k, v, block_mask=bm)
        allowed = (torch.arange(S) < lens[:Bc, None]).view(Bc, 1, 1, S)
        ref = golden(q, k, v, mask=allowed)[0]
        assert (out.double() - ref).abs().max().item() <= budget(torch.float32, 16, S), (Bc, Hc)


def test_points_are_not_used_for_a_call_past_the_decode_size():
    L, S = 1, 200
    bm = attnkit.create_block_mask(lambda b, h, qi, kv: kv < 150, None, None, L, S)
    rec = bm._attnkit_points
    assert rec.points(bm, 1, 8, L, S, torch.device("cpu")) is not None
    assert rec.points(bm, 1024, 8, L, S, torch.device("cpu")) is None  # (past 2^20 points: the plan's way)


def test_a_key_block_far_longer_than_the_keys():
    """One key block of 2^24 over 300 keys (a BlockMask from_kv_blocks): its points without a block's worth of
    memory per row, exact."""
    from torch.nn.attention.flex_attention import BlockMask

    L, S = 1, 300
    bm = BlockMask.from_kv_blocks(torch.ones(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                                  BLOCK_SIZE=(128, 1 << 24), mask_mod=lambda b, h, qi, kv: kv % 3 == 0,
                                  seq_lengths=(L, S))
    q, k, v = _inputs(L, S, 12)
    out = attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    allowed = (torch.arange(S) % 3 == 0).view(1, 1, 1, S)
    assert (out.double() - _flex_ref(q, k, v, allowed)).abs().max().item() <= budget(torch.float32, D, S)


def test_reading_a_block_masks_fields_leaves_them_as_they_were():
    """Keeping and checking the points reads the fields' bytes without ``.numpy()`` (which would leave the user's
    tensors unable to ``resize_``)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm

    L, S = 1, 300
    bm = torch_cbm(lambda b, h, qi, kv: kv < 200, None, None, L, S, device="cpu")
    q, k, v = _inputs(L, S, 13)
    for _ in range(2):  # (the first call keeps the points, the second checks them)
        attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert _uses_points(bm, L, S)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        t = getattr(bm, name)
        t.resize_(t.shape)  # (raises on a storage NumPy has viewed)


def _causal(b, h, qi, kv):  # a module-level mod: a BlockMask pickles with its mask_mod by reference
    return qi >= kv


@pytest.mark.parametrize("who", ["attnkit", "torch"])
def test_a_block_mask_holding_points_pickles_and_copies_and_answers_as_before(who):
    """The kept points' key holds code objects: pickle.dumps / torch.save of such a BlockMask failed ("cannot pickle
    code objects", never naming attnkit) — for torch's own BlockMask too, once one decode call had read it. The cache
    is left behind; the copy answers the same, reading its blocks again."""
    import copy
    import io
    import pickle

    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    L, S = 8, 8
    bm = (attnkit.create_block_mask if who == "attnkit" else torch_create_block_mask)(_causal, None, None, L, S,
                                                                                      device="cpu")
    q, k, v = _inputs(L, S)
    want = attnkit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert getattr(bm, "_attnkit_points", None) is not None
    for again in (pickle.loads(pickle.dumps(bm)), copy.deepcopy(bm)):
        assert getattr(again, "_attnkit_points", None) is None
        torch.testing.assert_close(attnkit.flex_attention(q, k, v, block_mask=again, enable_gqa=True), want,
                                   rtol=0, atol=0)
    buf = io.BytesIO()
    torch.save({"bm": bm}, buf)
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=False)["bm"].kv_indices, bm.kv_indices)
