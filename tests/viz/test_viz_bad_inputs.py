"""The pages and pictures name an argument of the wrong kind (Python's own errors said "'Tensor' object has no
attribute 'q'" or "string indices must be integers"), and a failed save leaves no empty file behind."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import viz


def _tile_mass():
    g = torch.Generator().manual_seed(0)
    return attnkit.tile_mass(torch.randn(1, 2, 32, 8, generator=g), torch.randn(1, 2, 32, 8, generator=g),
                             block=(16, 16))


@pytest.mark.parametrize("call, message", [
    (lambda p: viz.explain_page(torch.randn(3, 3)), r"trace: expected an attnkit.explain\(q, k, v\) Trace, got Tensor"),
    (lambda p: viz.save_explain_page(p, "t"), r"trace: expected an attnkit.explain\(q, k, v\) Trace, got str"),
    (lambda p: viz.tile_mass_page(torch.randn(3, 3)), r"tm: expected an attnkit.tile_mass\(q, k\) TileMass"),
    (lambda p: viz.tile_mass_page(_tile_mass(), maps=[_tile_mass()]), r"maps: expected a list of \(name, TileMass\)"),
    (lambda p: viz.tile_mass_page(_tile_mass(), maps=[("a", 3)]), r"maps\[0\]\[1\]: expected an attnkit.tile_mass"),
    (lambda p: viz.save_heads_png(p, "w", ["a"]), r"weights: expected an array of attention weights"),
    (lambda p: viz.save_attention_html(p, ["a"], {0: torch.rand(1, 1, 1, 1)}), r"items: expected a list of"),
    (lambda p: viz.save_attention_html(p, [{"label": "a", "tokens": ["x", "y"]}], torch.rand(1, 2, 2, 2)),
     r"weights: expected a dict \{layer: \(B, H, L, S\) array\}, got Tensor. For one layer pass \{0: weights\}"),
])
def test_a_wrong_kind_of_argument_is_named_and_leaves_no_file(tmp_path, call, message):
    path = tmp_path / "out"
    with pytest.raises(TypeError, match=message):
        call(path)
    assert not path.exists()


def test_heads_png_takes_weights_that_want_a_gradient(tmp_path):
    w = torch.softmax(torch.randn(2, 3, 3), -1).requires_grad_()
    path = viz.save_heads_png(tmp_path / "w.png", w, ["a", "b", "c"])
    assert (tmp_path / "w.png").stat().st_size > 0 and path.endswith("w.png")


def _other_tile_mass(L=32, block=(16, 16)):
    g = torch.Generator().manual_seed(1)
    return attnkit.tile_mass(torch.randn(1, 2, L, 8, generator=g), torch.randn(1, 2, L, 8, generator=g), block=block)


@pytest.mark.parametrize("kwargs, message", [
    # a map of other sizes was drawn on tm's grid: tiles of a 48-row input placed as if they were tm's
    ({"maps": [("a", _tile_mass()), ("b", _other_tile_mass(L=48))]}, r"maps\[1\]: expected a TileMass of tm's sizes "
                                                                     r"\(B=1, H=2, L=32, S=32, block=\(16, 16\)\), "
                                                                     r"got B=1, H=2, L=48, S=48"),
    ({"maps": [("a", _tile_mass()), ("b", _other_tile_mass(block=(8, 8)))]}, r"maps\[1\].*block=\(8, 8\)"),
    ({"rows": [3.9]}, r"rows: expected query rows, ints in 0..31, got 3.9"),  # was read as row 3
    ({"rows": [True]}, r"rows: expected query rows, ints in 0..31, got True"),
    ({"rows": [32]}, r"rows: expected query rows, ints in 0..31, got 32"),
    ({"b": -1}, r"b: expected a batch row in 0..0, got -1"),  # was read as the last row where no row was embedded
])
def test_the_page_refuses_maps_rows_and_batch_rows_it_cannot_draw(kwargs, message):
    tm = _tile_mass()
    if "maps" in kwargs:
        kwargs = {"maps": [("a", tm), kwargs["maps"][1]]}
    with pytest.raises(ValueError, match=message):
        viz.tile_mass_page(tm, **kwargs)


def test_the_page_takes_numpy_and_tensor_rows():
    import numpy as np
    tm = _tile_mass()
    page = viz.tile_mass_page(tm, rows=[np.int64(3), torch.tensor(5), 7])
    assert '"rows":[3,5,7]' in page
