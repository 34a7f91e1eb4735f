"""attnkit.create_block_mask: torch's signature, torch's BlockMask, tile for tile (padding rule included)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import attnkit
from attnkit import masks

_DOC = torch.repeat_interleave(torch.arange(7), torch.tensor([40, 1, 90, 128, 17, 200, 124]))  # 600 ids
_LENGTHS = torch.tensor([300, 77])


def _mods():
    doc = _DOC
    return {
        "causal": lambda b, h, q, kv: q >= kv,
        "document": lambda b, h, q, kv: doc[q] == doc[kv],
        "causal & document": lambda b, h, q, kv: (q >= kv) & (doc[q] == doc[kv]),
        "prefix-lm": lambda b, h, q, kv: (kv <= q) | (kv < 150),
        "sliding window": lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 100),
        "dilated window": lambda b, h, q, kv: ((q - kv).abs() <= 120) & ((q - kv) % 3 == 0),
        "natten 2-D": lambda b, h, q, kv: (((q // 20) - (kv // 20)).abs() <= 2) & (((q % 20) - (kv % 20)).abs() <= 2),
        "global tokens": lambda b, h, q, kv: (q < 8) | (kv < 8) | ((q - kv).abs() < 50),
        "chunked": lambda b, h, q, kv: (kv <= q) & (q // 128 == kv // 128),
        "per-batch lengths": lambda b, h, q, kv: kv < _LENGTHS[b],
        "per-head": lambda b, h, q, kv: kv <= q - 64 * h,
    }


_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
           "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _assert_same(ours, theirs):
    assert ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    assert ours.seq_lengths == theirs.seq_lengths
    for f in _FIELDS:
        a, b = getattr(ours, f), getattr(theirs, f)
        assert a.dtype == b.dtype and a.shape == b.shape, (f, a.shape, b.shape)
        assert torch.equal(a, b), f


@pytest.mark.parametrize("name", list(_mods()))
@pytest.mark.parametrize("L, S, block", [(600, 600, 128), (257, 600, 64), (600, 333, (32, 128)), (1, 45, 16),
                                         # decode steps (a small grid: every point evaluated, tiles counted in NumPy)
                                         (1, 600, 128), (16, 600, 128), (3, 257, 64)])
def test_equal_to_torch_create_block_mask(name, L, S, block):
    mod = _mods()[name]
    B, H = (2, 3) if name in ("per-batch lengths", "per-head") else (None, None)
    theirs = torch_create_block_mask(mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)
    ours = attnkit.create_block_mask(mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)
    _assert_same(ours, theirs)
    assert ours.mask_mod is mod


def test_batch_and_heads_are_expanded_like_torch():
    mod = _mods()["causal"]
    ours = attnkit.create_block_mask(mod, 2, 4, 256, 256, BLOCK_SIZE=64)
    _assert_same(ours, torch_create_block_mask(mod, 2, 4, 256, 256, device="cpu", BLOCK_SIZE=64))
    assert ours.kv_num_blocks.shape == (2, 4, 4)


def test_bad_arguments_raise_with_the_fix():
    mod = _mods()["causal"]
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        attnkit.create_block_mask(mod, 1, 1, 64, 64, BLOCK_SIZE=(0, 16))
    with pytest.raises(ValueError, match="Q_LEN"):
        attnkit.create_block_mask(mod, 1, 1, 0, 64)
    with pytest.raises(TypeError, match="mask_mod"):
        attnkit.create_block_mask("causal", 1, 1, 64, 64)


@pytest.mark.parametrize("name", list(_mods()))
@pytest.mark.parametrize("B, H, L, S, block", [(1, 1, 1, 600, (128, 128)), (2, 3, 5, 300, (64, 64)),
                                               (1, 2, 130, 100, (64, 32)), (2, 1, 16, 257, (16, 128))])
def test_a_small_grids_kinds_equal_the_evaluated_kinds(name, B, H, L, S, block):
    """A decode step's small grid, counted tile by tile in NumPy (off a row's bytes where the row is shared), gives
    the kinds of evaluating the mod chunk by chunk in torch, ragged edge tiles (full on their real points) too."""
    from attnkit import masks

    m = masks.from_mod(_mods()[name])
    fast = masks._small_grid_kinds(m.bind(L, S), B, H, L, S, *block)
    slow = masks._evaluated_kinds(m.bind(L, S), B, H, L, S, *block)
    assert fast.dtype == slow.dtype == torch.int8 and torch.equal(fast, slow)


def test_a_small_grids_mod_returning_int_raises_as_before():
    with pytest.raises(TypeError, match="bool"):
        attnkit.create_block_mask(lambda b, h, q, kv: (kv <= q).int(), None, None, 1, 300)


@pytest.mark.parametrize("name", ["causal", "document", "per-head"])
@pytest.mark.parametrize("L, S, block", [(257, 600, 64), (1, 600, 128), (16, 600, (32, 128))])
def test_large_map_path_gives_the_same_block_mask(monkeypatch, name, L, S, block):
    """The BlockMask built with torch ops (a large block map) equals the one built with NumPy (a small one) and
    torch's own, padding rule included; and reading it back (flex_attention's plan) gives the same kinds."""
    from attnkit import _blockmask, plans

    mod = _mods()[name]
    B, H = (2, 3) if name == "per-head" else (None, None)
    small = attnkit.create_block_mask(mod, B, H, L, S, BLOCK_SIZE=block)
    monkeypatch.setattr(plans, "_SMALL_MAP", -1)
    monkeypatch.setattr(plans, "_TINY_MAP", -1)
    monkeypatch.setattr(_blockmask, "_SMALL_BLOCKS", -1)
    large = attnkit.create_block_mask(mod, B, H, L, S, BLOCK_SIZE=block)
    _assert_same(large, small)
    _assert_same(large, torch_create_block_mask(mod, B, H, L, S, device="cpu", BLOCK_SIZE=block))
    Bq, Hq = B or 1, H or 1
    monkeypatch.setattr(masks, "_SMALL_GRID_ROWS", 0)  # (a plan, not a decode step's points: its kinds compared)
    read_large = _blockmask._block_mask_plan(large, Bq, Hq, L, S, torch.device("cpu"), "bm")
    monkeypatch.setattr(_blockmask, "_SMALL_BLOCKS", 1 << 12)
    read_small = _blockmask._block_mask_plan(large, Bq, Hq, L, S, torch.device("cpu"), "bm")
    assert torch.equal(read_large.mask.kinds, read_small.mask.kinds)


@pytest.mark.parametrize("L, S", [(600, 600), (3, 257)])  # a plan's map, and a decode step's evaluated points
@pytest.mark.parametrize("kw", [dict(separate_full_blocks=False), dict(compute_dq_write_order=True),
                                dict(compute_dq_write_order=True, dq_kv_order=False)], ids=str)
def test_torchs_other_keywords_give_torchs_block_mask(kw, L, S):
    """torch 2.13's separate_full_blocks / compute_dq_write_order / dq_kv_order (they raised TypeError): the
    same fields as torch's, the write order included, and a block mask whose answer is the mod's."""
    mod = _mods()["document"]
    theirs = torch_create_block_mask(mod, None, 2, L, S, device="cpu", **kw)
    ours = attnkit.create_block_mask(mod, None, 2, L, S, **kw)
    for f in (*_FIELDS, "dq_write_order", "dq_write_order_full"):
        a, b = getattr(ours, f, None), getattr(theirs, f, None)
        assert (a is None and b is None) or torch.equal(a, b), f
    assert getattr(ours, "dq_kv_order_spt", None) == getattr(theirs, "dq_kv_order_spt", None)
    q, k, v = (torch.randn(1, 2, n, 16, dtype=torch.float64) for n in (L, S, S))
    want = attnkit.attention(q, k, v, mask=attnkit.masks.from_mod(mod))
    torch.testing.assert_close(attnkit.flex_attention(q, k, v, block_mask=ours), want)
    with pytest.raises(ValueError, match=r"dq_kv_order: expected a bool"):
        attnkit.create_block_mask(mod, None, None, L, S, dq_kv_order="spt")


def test_lengths_given_as_numpy_or_tensor_integers_are_taken_as_torch_takes_them():
    import numpy as np

    mod = _mods()["causal"]
    ours = attnkit.create_block_mask(mod, np.int64(2), None, np.int64(300), torch.tensor(300))
    _assert_same(ours, torch_create_block_mask(mod, 2, None, 300, 300, device="cpu"))
    assert ours.seq_lengths == (300, 300) and all(type(n) is int for n in ours.seq_lengths)
    with pytest.raises(ValueError, match=r"Q_LEN: expected an int >= 1, got 300.0"):
        attnkit.create_block_mask(mod, None, None, 300.0, 300)
