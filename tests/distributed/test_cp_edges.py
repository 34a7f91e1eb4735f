"""Context parallelism at its edges, on W = 2 gloo processes, against float64 references: a user's ``Mask`` subclass
whose pattern depends on the head or the batch row (planned as head 0's and batch row 0's before: 1.7–3.5 off);
values the ranks hold differently where the content digest did not look (NumPy scalars, a class attribute, an
object with ``__slots__``, a private list, a module's private tensor) refused on every rank (a NumPy window in a
mask_mod aborted both processes in gloo); ranks backpropagating different calls refused before any exchange (each
rank's dK mixed two calls' partials); ``causal="False"``, a negative timeout and bad sizes refused by name."""

from __future__ import annotations

import _cp_spawn
import numpy as np
import pytest
import torch
from _cp_spawn import error_of

L, D = 12, 8


class _Cfg:  # a class attribute a score_mod reads
    slope = 0.0


class _Slotted:
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t

    def __call__(self, s, b, h, q, kv):
        return s + self.t[h] * (kv - q)


class _PrivList:
    def __init__(self, t):
        self._tabs = [t]

    def __call__(self, s, b, h, q, kv):
        return s + self._tabs[0][h] * (kv - q)


class _ModPriv(torch.nn.Module):
    def __init__(self, t):
        super().__init__()
        self._bias = t

    def forward(self, s, b, h, q, kv):
        return s + self._bias[h] * (kv - q)


def _ref(q, k, v, allowed):
    s = (q @ k.transpose(-1, -2)) / D ** 0.5
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v


def _edges(rank, W):
    import attnkit.distributed as akd
    from attnkit import masks

    class HeadMask(masks.Mask):  # head 0: a band; head 1: the first three keys
        def bind(self, L, S):
            return lambda b, h, q, kv: torch.where(h == 0, (q - kv).abs() <= 1, kv <= 2)

    class BatchMask(masks.Mask):  # batch row 0: a band; row 1: the first three keys
        def bind(self, L, S):
            return lambda b, h, q, kv: torch.where(b == 0, (q - kv).abs() <= 1, kv <= 2)

    out: dict = {}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, L, D, generator=g, dtype=torch.float64) for _ in range(3))

    # 1. a user's Mask subclass, head- or batch-dependent, on every transport; forward and backward
    for name, mask in (("head", HeadMask()), ("batch", BatchMask())):
        allowed = mask.materialize(2, 2, L, L)
        for comm in ("p2p", "allgather", "heads"):
            cp = akd.ContextParallel(L, mask=mask, layout="zigzag", comm=comm, block=2, timeout=60)
            qs, ks, vs = (cp.shard(t).requires_grad_() for t in (q, k, v))
            o = cp.attention(qs, ks, vs)
            o.backward(cp.shard(q))
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            ref = _ref(ql, kl, vl, allowed)
            ref.backward(q)
            rows = cp.positions
            dk = ks.grad.clone()  # this rank's keys' gradient: every rank's partials summed
            out[f"{name} {comm}"] = max((o - ref[:, :, rows]).abs().max().item(),
                                        (qs.grad - ql.grad[:, :, rows]).abs().max().item(),
                                        (dk - kl.grad[:, :, rows]).abs().max().item())

    # 2. values held differently per rank where the digest did not look
    x = 0.3 if rank == 0 else 0.9
    t = torch.tensor([x, x], dtype=torch.float64)
    s_np = np.float32(x)
    w_np = np.int64(2 if rank == 0 else 5)
    _Cfg.slope = x
    cases = {
        "numpy scale": dict(scale=np.float32(x)),
        "numpy scalar in a closure": dict(score_mod=lambda sc, b, h, qi, kv: sc + s_np * (kv - qi)),
        "class attribute": dict(score_mod=lambda sc, b, h, qi, kv: sc + _Cfg.slope * (kv - qi)),
        "__slots__ object": dict(score_mod=_Slotted(t)),
        "private list": dict(score_mod=_PrivList(t)),
        "module's private tensor": dict(score_mod=_ModPriv(t)),
        "numpy window in a mask_mod": dict(mask=masks.from_mod(lambda b, h, qi, kv: (qi - kv).abs() <= w_np)),
    }
    for name, kw in cases.items():
        c = akd.ContextParallel(L, mask=kw.pop("mask", None), layout="contiguous", timeout=60)
        out[name] = error_of(lambda c=c, kw=kw: c.attention(c.shard(q), c.shard(k), c.shard(v), **kw))

    # 3. rank 0 backpropagates the first of two calls, rank 1 the second
    cp = akd.ContextParallel(L, mask=masks.causal(), timeout=60)
    xs = [cp.shard(t).requires_grad_() for t in (q, k, v, q.flip(2), k.flip(2), v.flip(2))]
    o1, o2 = cp.attention(*xs[:3]), cp.attention(*xs[3:])
    out["other call's backward"] = error_of(lambda: (o1 if rank == 0 else o2).sum().backward())

    # 4. arguments refused by name
    cp = akd.ContextParallel(L, mask=masks.causal(), timeout=60)
    out["causal='False'"] = error_of(lambda: cp.attention(cp.shard(q), cp.shard(k), cp.shard(v), causal="False"))
    for name, kw in {"timeout=-1": dict(timeout=-1), "block='3'": dict(block="3"), "block=0": dict(block=0),
                     "seq_len=0": dict(seq_len=0), "batch=0": dict(batch=0)}.items():
        out[name] = error_of(lambda kw=kw: akd.ContextParallel(**{"seq_len": L, **kw}))
    out["gather of the full tensor"] = error_of(lambda: cp.gather(q))
    out["a 4-argument score_mod"] = error_of(lambda: cp.attention(cp.shard(q), cp.shard(k), cp.shard(v),
                                                                score_mod=lambda s, b, h, qi: s))
    # the group still runs after every refusal (a negative timeout marked it dead before)
    out["after"] = (cp.attention(cp.shard(q), cp.shard(k), cp.shard(v))
                    - _ref(q, k, v, torch.ones(L, L, dtype=torch.bool).tril())[:, :, cp.positions]).abs().max().item()
    return out


@pytest.fixture(scope="module")
def results():
    return _cp_spawn.run(2, _edges)


def test_a_users_mask_subclass_that_depends_on_the_head_or_batch_row_runs_as_in_one_process(results):
    for rank, r in sorted(results.items()):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        for name in ("head", "batch"):
            for comm in ("p2p", "allgather", "heads"):
                assert r[f"{name} {comm}"] < 1e-12, (rank, name, comm, r[f"{name} {comm}"])


@pytest.mark.parametrize("case", ["numpy scale", "numpy scalar in a closure", "class attribute", "__slots__ object",
                                  "private list", "module's private tensor", "numpy window in a mask_mod"])
def test_values_the_ranks_hold_differently_are_refused_on_every_rank(results, case):
    for rank, r in sorted(results.items()):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r[case].startswith("ContextParallelError") and "ranks disagree on" in r[case], (rank, r[case])


def test_ranks_backpropagating_different_calls_are_refused(results):
    for rank, r in sorted(results.items()):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        msg = r["other call's backward"]
        assert msg.startswith("ContextParallelError") and "rank 0 runs the backward of call #1, rank 1 that of " \
            "call #2" in msg and "in the same order" in msg, (rank, msg)


@pytest.mark.parametrize("case, needle", [
    ("causal='False'", "causal: expected True or False, got 'False'"),
    ("timeout=-1", "timeout: expected None (the process group's timeout) or a finite number of seconds > 0, got -1"),
    ("block='3'", "block: expected an int >= 1 or None, got '3'"),
    ("block=0", "block: expected an int >= 1 or None, got 0"),
    ("seq_len=0", "seq_len: expected an int >= 1, got 0"),
    ("batch=0", "batch: expected an int >= 1 or None, got 0"),
    ("gather of the full tensor", "gather: rank {rank} owns 6 rows, got (2, 2, 12, 8) with 12 on dim 2"),
    ("a 4-argument score_mod", "score_mod: expected a function of 5 arguments"),
])
def test_bad_arguments_are_refused_by_name_and_the_group_runs_on(results, case, needle):
    for rank, r in sorted(results.items()):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert needle.format(rank=rank) in r[case], (rank, r[case])
        assert r["after"] < 1e-12, (rank, r["after"])


def test_which_masks_are_planned_for_one_head():
    """A context-parallel schedule plans one head of one row only for masks that say their tiles are the same for
    every head: attnkit's closed forms (and their &, |, ~), or a user's subclass that sets it itself; a subclass
    that does not (even of a built-in: it may override bind), a mask_mod and a combination holding one are planned
    per row and head."""
    from attnkit import masks
    from attnkit.distributed.schedules import _needs_bh

    class Mine(masks.Mask):
        def bind(self, L, S):
            return lambda b, h, q, kv: q >= kv

    class MineDeclared(Mine):
        same_for_every_head = True

    class MyCausal(masks.Causal):
        def bind(self, L, S):
            return lambda b, h, q, kv: (q >= kv) & (h == 0)

    mod = masks.from_mod(lambda b, h, q, kv: q >= kv)
    one_head = [masks.causal(), masks.sliding_window(4), masks.document(torch.tensor([0, 0, 1])), masks.padding([3]),
                masks.causal() & masks.sliding_window(4), ~masks.causal(), MineDeclared()]
    every_head = [Mine(), MyCausal(), mod, masks.causal() & mod, masks.causal() | Mine()]
    assert [_needs_bh(m) for m in one_head] == [False] * len(one_head)
    assert [_needs_bh(m) for m in every_head] == [True] * len(every_head)
