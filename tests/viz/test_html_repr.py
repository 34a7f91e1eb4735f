"""Rich display in Jupyter: the HTML of a Trace, a mask, a plan and a dispatch Decision shows
the object's own numbers, escapes text and holds no external asset."""

from __future__ import annotations

import re

import numpy as np
import torch

import attnkit
from attnkit import masks

Q3 = np.array([[1.0, 0], [0, 1], [1, 1]])
K3 = np.array([[1.0, 1], [1, 0], [0, 1]])
V3 = np.array([[10.0, 0], [0, 10], [5, 5]])


def _cells(html: str) -> list[str]:
    return re.findall(r"<td[^>]*>([^<]*)</td>", html)


def _no_assets(html: str):
    assert not re.search(r"(src|href)\s*=|<script|url\(|https?:", html)


def test_trace_html_shows_each_step_with_its_numbers():
    t = attnkit.explain(Q3, K3, V3)
    html = t._repr_html_()
    cells = _cells(html)
    # the weights table of the 3-token example, row by row, and its first output row
    w = re.search(r'class="attnkit-weights">(.*?)</table>', html).group(1)
    assert _cells(w)[:3] == ["0.4011", "0.4011", "0.1978"]
    assert "background:rgb(" in w  # a heatmap: coloured cells
    assert ["5.0000", "5.0000"] == cells[-6:-4]
    assert "10.0000" in cells  # V is shown (an input)
    assert "1/√2" in html and "0.707107" in html
    assert "Masked" not in html  # no mask, no masked step
    _no_assets(html)


def test_trace_html_masked_step_and_heads():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 3))
    t = attnkit.explain(q, k, v, causal=True)
    html = t._repr_html_()
    assert "Masked scores" in html and "-inf" in _cells(html)
    assert "head 0 of H=2" in html
    assert f"{t.weights[0, 2, 4]:.4f}" in _cells(html)
    assert "dv2" in html  # output columns named by the value dims (Dv = 3)


def test_trace_repr_is_short_and_plain():
    t = attnkit.explain(Q3, K3, V3)
    assert repr(t) == "Trace(L=3, S=3, D=2, Dv=2, scale=0.707107, masked=False)"
    t4 = attnkit.explain(torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 6, 5), torch.zeros(2, 3, 6, 7), causal=True)
    assert repr(t4) == "Trace(B=2, H=3, L=4, S=6, D=5, Dv=7, scale=0.447214, masked=True)"


def test_mask_html_is_the_drawn_grid():
    m = masks.sliding_window(2)
    html = m._repr_html_()
    dense = m.materialize(1, 1, 8, 8)[0, 0]
    tds = re.findall(r"<td[^>]*background:(#[0-9a-f]+)", html)
    assert len(tds) == 64
    assert [c == "#1c7ed6" for c in tds] == dense.flatten().tolist()
    assert f"{int(dense.sum())} of 64 pairs attend" in html
    _no_assets(html)


def test_mask_html_escapes_text():
    class Evil(masks.Mask):
        def bind(self, L, S):
            return lambda b, h, q, kv: q >= kv

        def __repr__(self):
            return "<script>alert('x')</script>"

    html = Evil()._repr_html_()
    assert "<script>" not in html and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html


def test_plan_html_is_the_tile_map():
    p = attnkit.plan(masks.causal(), L=256, S=256, block=(64, 64))
    html = p._repr_html_()
    tds = re.findall(r'<td title="q(\d+) · k(\d+): (\w+)', html)
    kinds = p.kinds[0, 0]
    names = {0: "empty", 1: "partial", 2: "full"}
    assert len(tds) == 16
    for i, j, kind in tds:
        assert names[int(kinds[int(i), int(j)])] == kind
    assert "10 of 16 computed (62.5%)" in html and "6 full, 4 partial, 6 empty" in html


def test_decision_html_names_backend_worker_and_why():
    q = torch.randn(1, 2, 300, 8)
    d = attnkit.dispatch(q, q, q, mask=masks.sliding_window(16))
    html = d._repr_html_()
    cells = _cells(html)
    assert d.backend in html and d.worker in html
    from html import escape
    assert escape(d.reason) in cells and escape(d.worker_reason) in cells
