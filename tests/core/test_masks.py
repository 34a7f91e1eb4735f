"""Every built-in mask against its plain, loop-by-loop dense definition."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks


def dense(fn, B, H, L, S):
    return torch.tensor([[[[bool(fn(b, h, i, j)) for j in range(S)] for i in range(L)] for h in range(H)]
                         for b in range(B)])


SIZES = [(1, 1), (1, 7), (5, 5), (7, 3), (6, 11)]


@pytest.mark.parametrize("L, S", SIZES)
def test_causal_both_alignments(L, S):
    assert torch.equal(masks.causal().materialize(1, 1, L, S), dense(lambda b, h, i, j: j <= i + S - L, 1, 1, L, S))
    assert torch.equal(masks.causal("top_left").materialize(1, 1, L, S), dense(lambda b, h, i, j: j <= i, 1, 1, L, S))


@pytest.mark.parametrize("L, S", SIZES)
@pytest.mark.parametrize("w", [1, 2, 4, 100])
def test_sliding_window(L, S, w):
    ref = dense(lambda b, h, i, j: i + S - L - w < j <= i + S - L, 1, 1, L, S)
    assert torch.equal(masks.sliding_window(w).materialize(1, 1, L, S), ref)


@pytest.mark.parametrize("L, S", SIZES)
def test_padding(L, S):
    lengths = [S, max(0, S - 2), 0]
    ref = dense(lambda b, h, i, j: j < lengths[b], 3, 2, L, S)
    assert torch.equal(masks.padding(lengths).materialize(3, 2, L, S), ref)


@pytest.mark.parametrize("L, S", [(5, 5), (1, 7), (3, 11)])
def test_document(L, S):
    ids = [j * 3 // S for j in range(S)]
    ref = dense(lambda b, h, i, j: ids[i + S - L] == ids[j], 1, 1, L, S)
    assert torch.equal(masks.document(ids).materialize(1, 1, L, S), ref)
    ids2 = [ids, list(reversed(ids))]
    ref2 = dense(lambda b, h, i, j: ids2[b][i + S - L] == ids2[b][j], 2, 1, L, S)
    assert torch.equal(masks.document(ids2).materialize(2, 1, L, S), ref2)


@pytest.mark.parametrize("L, S", SIZES)
@pytest.mark.parametrize("p", [0, 1, 3])
def test_prefix_lm(L, S, p):
    p = min(p, S)
    ref = dense(lambda b, h, i, j: j < p or j <= i + S - L, 1, 1, L, S)
    assert torch.equal(masks.prefix_lm(p).materialize(1, 1, L, S), ref)


def test_combinators():
    L = S = 9
    a, b = masks.sliding_window(3), masks.prefix_lm(2)
    A, Bm = a.materialize(1, 1, L, S), b.materialize(1, 1, L, S)
    assert torch.equal((a & b).materialize(1, 1, L, S), A & Bm)
    assert torch.equal((a | b).materialize(1, 1, L, S), A | Bm)
    assert torch.equal((~a).materialize(1, 1, L, S), ~A)
    head_mod = masks.from_mod(lambda b, h, q, kv: (h % 2 == 0) | (q == kv))
    ref = dense(lambda b, h, i, j: h % 2 == 0 or i == j, 2, 4, L, S)
    assert torch.equal(head_mod.materialize(2, 4, L, S), ref)
    with pytest.raises(TypeError, match="from_mod"):
        a & (lambda b, h, q, kv: q > kv)


def test_drawing():
    text = masks.prefix_lm(2).draw(4)
    assert text.splitlines()[1:] == ["q0 # # . .", "q1 # # . .", "q2 # # # .", "q3 # # # #"]
    assert "prefix_lm(2)" in str(masks.prefix_lm(2))
