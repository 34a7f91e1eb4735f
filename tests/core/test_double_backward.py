"""A double backward through attnkit (a gradient penalty, a Hessian-vector product): the gradients of the first
backward, taken with ``create_graph=True``, must carry a graph back to q, k, v and to a score_mod's learnable
tensor. The compiled kernel's and the tiled engine's gradients are numbers; differentiated again they would add
nothing, silently — under ``create_graph`` both rebuild the eager path's forward and differentiate it instead."""

from __future__ import annotations

import pytest
import torch
from conftest import rand_qkv

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM

CASES = [
    ("causal", dict(mask=M.causal())),
    ("window", dict(mask=M.sliding_window(20))),
    ("no mask", {}),
    ("padding", dict(mask=M.padding([70, 33]))),
    ("softcap", dict(mask=M.causal(), score_mod=SM.softcap(5.0))),
]


def _penalised(q, k, v, backend, kw, extra=()):
    """out.sum() + |d(out²)/dq|², differentiated w.r.t. q, k, v (and ``extra``)."""
    out = attnkit.attention(q, k, v, backend=backend, **kw)
    gq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    loss = out.sum() + gq.square().sum()
    return torch.autograd.grad(loss, (q, k, v, *extra))


@pytest.mark.parametrize("backend", ["tiled", "auto"])
@pytest.mark.parametrize("name, kw", CASES, ids=[c[0] for c in CASES])
def test_a_gradient_penalty_matches_float64(backend, name, kw):
    q, k, v = rand_qkv(2, 4, 2, 70, 70, 16, requires_grad=True)
    if backend == "auto" and name == "no mask":  # a small dense call: torch SDPA, whose backward torch cannot
        with pytest.raises(RuntimeError, match="not implemented"):  # differentiate — an error, not a lost term
            _penalised(q, k, v, backend, kw)
        return
    got = _penalised(q, k, v, backend, kw)
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _penalised(q2, k2, v2, "eager", kw)
    for n, a, b in zip("qkv", got, want, strict=True):
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert err < 1e-4, f"d{n}: {err:.2e} from float64 (a second-order term lost?)"


def test_a_learnable_score_mod_tensor_gets_its_second_order_gradient():
    slopes = (torch.rand(4) * 0.2).requires_grad_()
    q, k, v = rand_qkv(1, 4, 4, 64, 64, 16, requires_grad=True)
    kw = dict(mask=M.causal(), score_mod=SM.alibi(slopes))
    got = _penalised(q, k, v, "tiled", kw, extra=(slopes,))
    s2 = slopes.detach().double().requires_grad_()
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _penalised(q2, k2, v2, "eager", dict(mask=M.causal(), score_mod=SM.alibi(s2)), extra=(s2,))
    for a, b in zip(got, want, strict=True):
        assert ((a.double() - b).abs().max() / b.abs().max()).item() < 1e-4


def test_bf16_on_the_kernel():
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16, dtype=torch.bfloat16, requires_grad=True)
    got = _penalised(q, k, v, "tiled", dict(mask=M.causal()))
    want = _penalised(q, k, v, "eager", dict(mask=M.causal()))
    for a, b in zip(got, want, strict=True):  # the same bf16 math on both sides, up to fp32 rounding
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < 2e-2


@pytest.mark.parametrize("dtype, L", [(torch.float32, 70), (torch.bfloat16, 3)])
def test_a_replayed_call_on_the_kernel_keeps_its_second_order_terms(dtype, L):
    """auto's replays of one signature run the kernel's forward and backward prepared once (native._NativeStep);
    under ``create_graph`` they too differentiate the eager path's forward: the first call and two replays each
    match float64's penalty gradients (fp32 causal at L = 70; a bf16 decode-sized call over 70 keys)."""
    q, k, v = rand_qkv(1, 4, 2, L, 70, 16, dtype=dtype, requires_grad=True)
    kw = dict(mask=M.causal())
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _penalised(q2, k2, v2, "eager", kw)
    bound = 1e-4 if dtype == torch.float32 else 3e-2
    for _ in range(3):
        got = _penalised(q, k, v, "auto", kw)
        for n, a, b in zip("qkv", got, want, strict=True):
            err = ((a.double() - b).abs().max() / b.abs().max()).item()
            assert err < bound, f"d{n}: {err:.2e} from float64"
