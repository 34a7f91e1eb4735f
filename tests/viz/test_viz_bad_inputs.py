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
