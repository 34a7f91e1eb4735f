"""The autograd function of a row-sharded context-parallel call: stats, the transport's forward and
backward (:mod:`.transport`), the status exchange after the local compute."""

from __future__ import annotations

import torch

from .stats import Stats


class CPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp, sched, opts, q, k, v, *captured):
        ctx.set_materialize_grads(False)  # an unused lse has no gradient (None), not zeros
        r = cp.rank
        cp._sched = sched
        st = cp.stats = Stats()
        st.tiles_computed = int(sched.tiles[r].sum())
        st.tiles_skipped = int(sched.empty[r].sum())
        st.pairs_computed = int(sched.visible[r].sum())
        st.pairs_skipped = cp.W - st.pairs_computed
        out, lse2, kept, err = cp.transport.forward(cp, sched, opts, q.detach(), k.detach(), v.detach(), st)
        cp._status(err, "forward")
        assert out is not None and lse2 is not None, "_status raised the failure"
        ctx.cp, ctx.sched, ctx.opts, ctx.captured = cp, sched, opts, captured
        ctx.kv = kept
        ctx.save_for_backward(q, k, v)
        ctx.out, ctx.lse2 = out, lse2
        ctx.call = cp._calls
        return out.to(q.dtype), lse2[0] + lse2[1]

    @staticmethod
    def backward(ctx, dout, dlse):
        cp, sched = ctx.cp, ctx.sched
        cp._backward_check(ctx.call)  # before any exchange: a rank backpropagating another call would mix its partials
        q, k, v = ctx.saved_tensors
        cp._sched = sched
        st = cp.backward_stats = Stats()
        dq, dk, dv, cap = cp.transport.backward(cp, sched, ctx.opts, q.detach(), k.detach(), v.detach(), ctx, dout,
                                                dlse, st)
        return (None, None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *cap)
