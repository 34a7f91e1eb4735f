"""Built-in masks are values: the tensors they hold cannot change behind their cached tile maps.

issue 17: ``m = masks.padding([128, 100]); m.key_lengths[1] = 40`` made ``tiled``/``auto``
disagree with ``eager`` on the same object (cached work list vs fresh evaluation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_close, budget, rand_qkv

import attnkit
from attnkit import masks as M

B, H, L, S, D = 2, 2, 128, 128, 16


def _ids():
    return torch.repeat_interleave(torch.arange(4), torch.tensor([20, 50, 30, 28]))


# (name, build from data, attribute holding the data, how to change the data)
_CASES = [
    ("padding", lambda d: M.padding(d), "key_lengths", torch.tensor([128, 100])),
    ("key_padding", lambda d: M.key_padding(d), "valid", torch.arange(S).expand(B, S) < torch.tensor([[128], [90]])),
    ("document (S,)", lambda d: M.document(d), "doc_ids", _ids()),
    ("document (B, S)", lambda d: M.document(d), "doc_ids", torch.stack([_ids(), _ids().flip(0)])),
    ("document & causal", lambda d: M.document(d) & M.causal(), None, _ids()),
]


def _change(t: torch.Tensor):
    if t.dtype == torch.bool:
        t[..., 30:60] = ~t[..., 30:60]
    else:
        t.view(-1)[-40:] = t.view(-1)[-40:] // 2 + 1 if t.max() > 8 else 7


def _run_all(mask, q, k, v):
    return {b: attnkit.attention(q, k, v, mask=mask, backend=b) for b in ("eager", "tiled", "auto")}


@pytest.mark.parametrize("name, build, attr, data", _CASES, ids=[c[0] for c in _CASES])
def test_changing_the_data_a_mask_was_built_from_changes_nothing(name, build, attr, data):
    q, k, v = rand_qkv(B, H, H, L, S, D)
    src = data.clone()
    mask = build(src)
    before = _run_all(mask, q, k, v)  # fills the tile-map / work-list caches
    want = mask.materialize(B, H, L, S).clone()
    _change(src)  # the caller's tensor, in place
    if attr is not None:
        _change(getattr(mask, attr))  # the attribute: a copy, so this changes nothing either
        with pytest.raises(AttributeError):
            setattr(mask, attr, data)
    assert torch.equal(mask.materialize(B, H, L, S), want), "the mask changed with the data"
    after = _run_all(mask, q, k, v)
    tol = budget(torch.float32, D, S)
    for b in after:
        assert_close(after[b], before["eager"], tol, f"{name}: {b} after the change")
        assert_close(after[b], after["eager"], tol, f"{name}: {b} vs eager")


def test_issue_17_padding_repro():
    q, k, v = rand_qkv(2, 2, 2, 128, 128, 16)
    m = M.padding([128, 100])
    first = attnkit.attention(q, k, v, mask=m, backend="tiled")
    m.key_lengths[1] = 40
    assert m.key_lengths.tolist() == [128, 100]
    tol = budget(torch.float32, 16, 128)
    for b in ("eager", "tiled", "auto"):
        assert_close(attnkit.attention(q, k, v, mask=m, backend=b), first, tol, b)


def test_numpy_data_is_copied_too():
    lengths = np.array([128, 100])
    m = M.padding(lengths)
    lengths[1] = 3
    assert m.key_lengths.tolist() == [128, 100]


@pytest.mark.filterwarnings("error")
def test_a_score_past_float64s_range_is_minus_inf_on_every_backend_without_a_warning():
    """float64's ``finfo.min`` added twice (a score_mod's and a float mask's) leaves the range: -inf, as IEEE rounds
    it in torch's ops; the NumPy reference says so without a RuntimeWarning the caller can do nothing about."""
    fmin = torch.finfo(torch.float64).min
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (4, 5, 5))
    bias = torch.zeros(4, 5, dtype=torch.float64)
    bias[1] = fmin  # row 1: keys 0, 1 at -inf (both added), keys 2-4 at finfo.min (equal: 1/3 each)
    outs = {b: attnkit.attention(q, k, v, mask=bias, score_mod=lambda s, b, h, qi, kv: torch.where(kv < 2, s + fmin, s),
                                 backend=b) for b in ("reference", "eager", "tiled", "auto")}
    assert torch.allclose(outs["reference"][0, :, 1], v[0, :, 2:].mean(1), atol=1e-15, rtol=0)
    for b, out in outs.items():
        assert (out - outs["reference"]).abs().max().item() <= 1e-14, b


@pytest.mark.parametrize("L", [70, 4, 1])
def test_an_fp32_bias_with_bf16_inputs_is_added_in_fp32_on_auto(L):
    """SDPA takes a bias in the inputs' dtype: ``auto`` handed it a bf16-rounded fp32 bias (a bias of ~20 rounded by
    0.06; 0.054 off at the output against float64 where eager and tiled were 0.0065; a row of fp32 finfo.min had
    the lse of bf16's max). Such a call now runs where the bias stays fp32."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, L, 16, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 130, 16, generator=g).bfloat16() for _ in range(2))
    bias = torch.randn(L, 130, generator=g) * 3 + 20
    bias[0] = torch.finfo(torch.float32).min
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.25 + bias.double()
    want, want_lse = torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)
    eager = attnkit.attention(q, k, v, mask=bias, backend="eager")
    budget = 1.5 * (eager.double() - want).abs().max().item()
    for _ in range(2):  # the full path, then the fast path's replay
        out, lse = attnkit.attention(q, k, v, mask=bias, return_lse=True)
        assert (out.double() - want).abs().max() <= budget
        assert lse[0, :, 0].double().eq(want_lse[0, :, 0]).all() or (
            (lse[0, :, 0].double() - want_lse[0, :, 0]).abs() / want_lse[0, :, 0].abs()).max() < 1e-6
    assert attnkit.attention(q, k, v, mask=bias).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"SDPA would round it to torch\.bfloat16"):
        attnkit.attention(q, k, v, mask=bias, backend="sdpa")
