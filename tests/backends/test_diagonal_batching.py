"""The fused worker batches diagonal runs of ANY mask whose tiles it found exactly equal (issue 17):
an opaque sliding-window mask_mod is batched like the built-in window; a mod that differs at one
point of one tile is not batched across that tile, and every answer equals eager's."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, budget, fused, rand_qkv

import attnkit
from attnkit import masks as M
from attnkit.backends import _tiled_fused, tiled

L, W = 1024, 200


def _window(b, h, q, kv):
    return (kv <= q) & (q - kv < W)


def _window_with_a_hole(b, h, q, kv):
    # shift-invariant except one point: the tile holding (700, 650) differs from its diagonal
    return _window(b, h, q, kv) & ~((q == 700) & (kv == 650))


def _schedules(monkeypatch):
    seen = []
    real = _tiled_fused.schedule

    def spy(c):
        out = real(c)
        seen.append(out)
        return out

    monkeypatch.setattr(_tiled_fused, "schedule", spy)
    return seen


def _batched_groups(schedule):
    return sum(item[3] for item in schedule if item[0] == "batch")


@pytest.mark.skipif(not tiled._flash_cpu.available(), reason="the fused worker needs torch's CPU flash kernel")
@pytest.mark.parametrize("name, mask", [("builtin window", M.sliding_window(W)), ("opaque window", _window),
                                        ("window with a hole", _window_with_a_hole)])
def test_diagonal_batches_are_found_from_the_tiles(monkeypatch, name, mask):
    q, k, v = rand_qkv(1, 2, 2, L, L, 32, requires_grad=True)
    seen = _schedules(monkeypatch)
    with tiled.block_sizes(64, 64), fused(True):  # the fused worker's batching (the compiled kernel has none)
        out = attnkit.attention(q, k, v, mask=mask, backend="tiled")
        out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = attnkit.attention(q, k, v, mask=mask, backend="eager")
    ref.sum().backward()
    tol = budget(torch.float32, 32, L)
    assert_close(out, ref, tol, name)
    for g, t in zip(grads, (q, k, v), strict=True):
        assert_close(g, t.grad, 4 * tol, f"{name}: gradient")
    batched = _batched_groups(seen[0])
    groups = sum(1 if item[0] == "group" else item[3] for item in seen[0])
    if name == "window with a hole":
        # the hole's query block (700 // 64 = 10) is never inside a batch
        for item in seen[0]:
            if item[0] == "batch":
                _, i0, rows, nb, *_ = item  # ("batch", i0, l, nb, ...): nb runs of l query rows
                assert not (i0 <= 700 < i0 + nb * rows), "a tile that differs was batched"
        assert 0 < batched < groups
    else:
        assert batched >= groups - 5, f"{name}: only {batched} of {groups} query blocks batched"
