"""Forward + backward give the same bits on every run: every CPU path, at 2 and 4 threads.

The compiled kernel's backward adds each key tile's dQ share in key-tile order (csrc ``wait_turn``),
so dq, dk, dv (and lse, out) are bitwise identical run to run, and across thread counts. The case
FlashAttention's ``test_flash_attn_deterministic`` runs (window 100, B = 4, H = 9 / 3, L = 257,
S = 239, D = 59) is here as it is there; ``torch.use_deterministic_algorithms(True)`` runs every
CPU path unchanged, and ``dispatch`` says the path is deterministic.
"""

from __future__ import annotations

import pytest
import torch
from _flashmask import families
from conftest import rand_qkv

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM

REPEATS = 4  # benchmarks/reproducible.py runs 100


def _grads(q, k, v, extra=(), with_lse=True, **kw):
    g = torch.Generator().manual_seed(1)
    if not with_lse:
        out = attnkit.attention(q, k, v, **kw)
        return [out, *torch.autograd.grad((out * torch.randn(out.shape, generator=g)).sum(), (q, k, v, *extra))]
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw)
    go = torch.randn(out.shape, generator=g)
    gl = torch.randn(lse.shape, generator=g).masked_fill(~torch.isfinite(lse), 0)
    loss = (out * go).sum() + (lse.masked_fill(~torch.isfinite(lse), 0) * gl).sum()
    return [out, lse, *torch.autograd.grad(loss, (q, k, v, *extra))]


def _same_bits(runs):
    first = runs[0]
    for r in runs[1:]:
        for a, b in zip(first, r, strict=True):
            assert torch.equal(a, b) and a.dtype == b.dtype, "a repeated run gave other bits"


def _cases():
    mods = families(300, H=6, seed=3)
    return [
        ("flash_attn_deterministic", (4, 9, 3, 257, 239, 59), {"mask": M.sliding_window(100)}, "native"),
        ("causal", (2, 4, 2, 300, 300, 64), {"causal": True}, "native"),
        ("documents", (1, 4, 4, 300, 300, 32), {"mask": M.document(torch.tensor([0] * 90 + [1] * 210))}, "native"),
        ("alibi", (1, 4, 2, 300, 300, 32),
         {"mask": M.causal(), "score_mod": SM.alibi(attnkit.positional.alibi_slopes(4))}, "native"),
        ("random_eviction_mod", (1, 6, 2, 300, 300, 32), {"mask": M.from_mod(mods["random_eviction"][0])}, "native"),
        ("share_question_mod", (2, 6, 3, 300, 300, 32), {"mask": M.from_mod(mods["share_question"][0])}, "native"),
        ("softcap", (1, 4, 2, 200, 200, 32), {"mask": M.causal(), "score_mod": SM.softcap(20.0)}, None),
    ]


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_repeated_forward_and_backward_give_the_same_bits(case, threads):
    _, (B, H, Hkv, L, S, D), kw, worker = case
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        q, k, v = rand_qkv(B, H, Hkv, L, S, D, requires_grad=True)
        d = attnkit.dispatch(q, k, v, backend="tiled", **kw)
        assert d.deterministic is True, d
        if worker is not None:
            assert d.worker == worker, d
        _same_bits([_grads(q, k, v, backend="tiled", **kw) for _ in range(REPEATS)])
    finally:
        torch.set_num_threads(saved)


def test_the_kernel_gives_the_same_bits_at_every_thread_count():
    q, k, v = rand_qkv(2, 6, 2, 333, 290, 40, requires_grad=True)
    kw = {"mask": M.sliding_window(70), "backend": "tiled"}
    saved = torch.get_num_threads()
    runs = []
    try:
        for t in (1, 2, 3, 4):
            torch.set_num_threads(t)
            runs.append(_grads(q, k, v, **kw))
    finally:
        torch.set_num_threads(saved)
    _same_bits(runs)


def test_gradients_into_captured_tensors_repeat_bitwise():
    """A learnable relative-position table read by a score_mod: its gradient repeats bitwise too."""
    table = torch.randn(2 * 150, requires_grad=True)

    def rel(score, b, h, q, kv):
        return score + table[q - kv + 149]

    q, k, v = rand_qkv(1, 2, 2, 150, 150, 16, requires_grad=True)
    assert attnkit.dispatch(q, k, v, mask=M.causal(), score_mod=rel, backend="tiled").worker == "native"
    saved = torch.get_num_threads()
    try:
        for t in (2, 4):
            torch.set_num_threads(t)
            runs = [_grads(q, k, v, extra=(table,), mask=M.causal(), score_mod=rel, backend="tiled") for _ in range(6)]
            _same_bits(runs)
    finally:
        torch.set_num_threads(saved)


def test_torch_deterministic_switch_runs_every_cpu_path():
    """Under torch.use_deterministic_algorithms(True) every CPU backend runs (none is nondeterministic) and
    repeats bitwise; dispatch says so."""
    q, k, v = rand_qkv(1, 2, 2, 130, 130, 32, requires_grad=True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert attnkit.dispatch(q.detach(), k.detach(), v.detach(), backend="reference").deterministic is True
        for backend in ("auto", "tiled", "sdpa", "eager"):
            kw = {"mask": M.causal(), "backend": backend}
            assert attnkit.dispatch(q, k, v, **kw).deterministic is True
            _same_bits([_grads(q, k, v, with_lse=backend != "sdpa", **kw) for _ in range(3)])
    finally:
        torch.use_deterministic_algorithms(was)
