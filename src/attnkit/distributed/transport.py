"""Transports: how K/V (or heads) travel between the ranks of a call. One class a mode.

A transport answers three questions for :class:`~attnkit.distributed.ContextParallel`:

* ``attention(cp, q, k, v, …)``: the whole call (the row-sharded modes hand it to the autograd
  function :class:`~attnkit.distributed.function.CPFunction`, which calls the two below);
* ``forward(cp, sched, opts, q, k, v, stats)`` → ``(out, (c, r), kept, error)``: this rank's rows,
  merged over every key rank that is visible to it (:mod:`.pairs`);
* ``backward(cp, sched, opts, q, k, v, ctx, dout, dlse, stats)`` → ``(dq, dk, dv, captured grads)``.

Modes (``comm=``)::

    p2p        P2P        K/V streamed round by round to exactly the ranks that see them
                          (at most two received shards held); dK/dV streamed back
    allgather  AllGather  every shard all-gathered (padded), dK/dV all-reduced; short sequences
    heads      Heads      all-to-all over heads (Ulysses): one attention over the whole sequence
                          for H/W heads, the output back by rows

A new mode is one class here and one entry in :data:`TRANSPORTS`.
"""

from __future__ import annotations

import torch

from .. import masks as _masks
from ..api import attention as _attention
from .function import CPFunction
from .pairs import _acc_dtype, _merge, _options, _pair, _rank_backward, _rank_forward, _RowsBackward
from .schedules import _needs_bh
from .stats import Stats


class Transport:
    """The interface (see the module docstring). ``attention`` runs the row-sharded autograd function."""

    name = ""

    def attention(self, cp, q, k, v, sched, opts, captured, causal, scale, score_mod, return_lse):
        return CPFunction.apply(cp, sched, opts, q, k, v, *captured)

    def forward(self, cp, sched, opts, q, k, v, st):
        raise NotImplementedError

    def backward(self, cp, sched, opts, q, k, v, ctx, dout, dlse, st):
        raise NotImplementedError


class _Stream:
    """Point-to-point rounds of one call (``comm="p2p"``): in round d = 1, 2, … rank r sends its shard
    to rank (r + d) mod W and receives rank (r − d) mod W's, each only where the schedule says that
    pair is visible, and rounds in which no pair is visible are skipped (a window talks to its
    neighbours in one round). Every rank walks the same rounds, each message has its round's tag,
    and a rank posts round d + 1 before it computes round d — so a rank holds at most **two**
    received shards (the one it computes on, the one in flight) whatever W is::

        W = 4, causal zigzag (every pair visible): rounds 1, 2, 3
        rank 0:  local pair │ recv 3 ──── compute 3 │ recv 2 ── compute 2 │ recv 1 ── compute 1
                            │        recv 2 in flight│     recv 1 in flight│
    """

    KV_TAG, GRAD_TAG = 1000, 3000

    def __init__(self, cp, sched, held_from: int = 0):
        self.cp, self.sched = cp, sched
        self.r, self.W, self.P = cp.rank, cp.W, cp.layout.positions
        self.rounds = sched.rounds()
        self.held = held_from  # received shards alive now (kept ones included)
        self.held_max = held_from

    def src(self, d):  # whose K/V this rank needs in round d (None: none)
        s = (self.r - d) % self.W
        return s if bool(self.sched.visible[self.r, s]) else None

    def dst(self, d):  # who needs this rank's K/V in round d (None: nobody)
        t = (self.r + d) % self.W
        return t if bool(self.sched.visible[t, self.r]) else None

    def post(self, d, send, recv_like, tag, what, send_to=None, recv_from=None):
        """Post round d: ``send`` (a tensor, or a function of the peer making it) to ``send_to`` and
        a receive like ``recv_like(peer)`` from ``recv_from`` (each skipped when None). Returns
        ``(peer, buffer, works)``; each work keeps its tensor alive until it is waited on."""
        cp, works, buf = self.cp, [], None
        if recv_from is not None:
            buf = recv_like(recv_from)
            works.append((recv_from, cp._issue(lambda: cp.dist.irecv(buf, src=cp._g(recv_from), group=cp.group,
                                                                     tag=tag + d), what, recv_from), "recv", buf))
        if send_to is not None and send is not None:
            t = send(send_to) if callable(send) else send
            works.append((send_to, cp._issue(lambda: cp.dist.isend(t, dst=cp._g(send_to), group=cp.group,
                                                                   tag=tag + d), what, send_to), "send", t))
        return recv_from, buf, works

    def wait(self, works, what):
        for peer, w, kind, _ in works:
            self.cp._wait(w, peer, f"{what} ({kind})")

    @staticmethod
    def sent_bytes(works) -> int:
        return sum(t.numel() * t.element_size() for _, _, kind, t in works if kind == "send")

    def hold(self, n: int):
        self.held += n
        self.held_max = max(self.held_max, self.held)


def _keeps(cp, sched, r: int) -> bool:
    """Whether rank r keeps the K/V it received in the forward for the backward: ``keep_kv=True``
    always, ``False`` never, ``"auto"`` when it received from at most one rank (a window's
    neighbour: keeping it holds no more than streaming would)."""
    if cp.keep_kv == "auto":
        return len(sched.recv_from[r]) <= 1
    return bool(cp.keep_kv)


class P2P(Transport):
    """``comm="p2p"``: K/V streamed to exactly the ranks whose queries see them (:class:`_Stream`)."""

    name = "p2p"

    def forward(self, cp, sched, opts, q, k, v, st):
        out, lse2, kept, err = _p2p_forward(cp, sched, opts, q, k, v, st, _keeps(cp, sched, cp.rank))
        return out, lse2, (kept if _keeps(cp, sched, cp.rank) else None), err

    def backward(self, cp, sched, opts, q, k, v, ctx, dout, dlse, st):
        return _p2p_backward(cp, sched, opts, q, k, v, ctx, dout, dlse, st)


class AllGather(Transport):
    """``comm="allgather"``: every shard all-gathered (padded to the longest), dK/dV all-reduced; the
    compute still skips invisible pairs. Memory: the whole K/V (for short sequences)."""

    name = "allgather"

    @staticmethod
    def exchange(cp, k, v, what, stats, meanwhile=None):
        """``comm="allgather"``: this rank's view ``{s: (k_s, v_s)}`` of the K/V shards it needs (its
        own included), every shard all-gathered (padded to the longest). ``comm="p2p"`` streams
        instead (:class:`P2P`)."""
        sched, r, P = cp._sched, cp.rank, cp.layout.positions
        assert sched is not None, "CPFunction sets the call's schedule first"
        D = k.shape[-1]
        kv = {r: (k, v)} if sched.visible[r, r] else {}
        packed = torch.cat([k.detach(), v.detach()], -1).contiguous()
        elt = packed.element_size()
        n = max(cp.layout.lengths)
        pad = packed.new_zeros(packed.shape[0], packed.shape[1], n, packed.shape[3])
        pad[:, :, :packed.shape[2]] = packed
        bufs = [torch.empty_like(pad) for _ in range(cp.W)]
        cp._check_alive()
        work = cp._issue(lambda: cp.dist.all_gather(bufs, pad, group=cp.group, async_op=True), what)
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            cp._wait(work, None, what)
        recv = {s: bufs[s][:, :, :len(P[s])] for s in range(cp.W) if s != r}
        stats.bytes_sent += pad.numel() * elt * (cp.W - 1)
        stats.bytes_received += pad.numel() * elt * (cp.W - 1)
        stats.peers_sent = stats.peers_received = tuple(s for s in range(cp.W) if s != r)
        for s, buf in recv.items():
            if sched.visible[r, s]:
                kv[s] = (buf[..., :D], buf[..., D:])
        return kv

    def forward(self, cp, sched, opts, q, k, v, st):
        r, P = cp.rank, cp.layout.positions
        err = out = lse2 = None
        local = {}

        def compute_local():  # the local pair runs while the K/V messages travel
            nonlocal err
            if sched.visible[r, r] and err is None:
                try:
                    local[r] = _pair(q, k, v, P[r], P[r], sched.blocks(r, r), opts)
                except Exception as e:
                    err = e

        kept = self.exchange(cp, k, v, "forward K/V exchange", st, compute_local)
        st.kv_held_max = sum(1 for s in kept if s != r)
        if err is None:
            try:
                out, c, rr = _rank_forward(q, kept, r, P[r], P, sched.row_blocks(r), opts, local, v.shape[-1])
                lse2 = (c, rr)
                st.steps = len(kept)
            except Exception as e:
                err = e
        return out, lse2, (kept if cp.keep_kv is not False else None), err

    def backward(self, cp, sched, opts, q, k, v, ctx, dout, dlse, st):
        r, P = cp.rank, cp.layout.positions
        acc = _acc_dtype(q.dtype)
        kv = ctx.kv if ctx.kv is not None else self.exchange(cp, k, v, "backward K/V exchange", st)
        err, dq, parts, cap = None, None, {}, []
        try:
            dq, parts, cap = _rank_backward(q, kv, r, P[r], P, sched.row_blocks(r), opts, ctx.out, ctx.lse2,
                                            dout, dlse, list(ctx.captured))
            st.steps = len(kv)
        except Exception as e:
            err = e
        cp._status(err, "backward")
        D = k.shape[-1]
        full = torch.zeros(k.shape[0], k.shape[1], cp.seq_len, D + v.shape[-1], dtype=acc, device=k.device)
        for s, (pk, pv) in parts.items():
            full[:, :, P[s]] += torch.cat([pk, pv], -1)
        cp._check_alive()
        what = "backward dK/dV all_reduce"
        cp._wait(cp._issue(lambda: cp.dist.all_reduce(full, group=cp.group, async_op=True), what), None, what)
        nbytes = full.numel() * full.element_size()
        st.bytes_sent += 2 * (cp.W - 1) * nbytes // cp.W  # ring all-reduce traffic per rank
        st.bytes_received += 2 * (cp.W - 1) * nbytes // cp.W
        own = full[:, :, P[r]]
        assert dq is not None, "_status raised the failure"
        return dq, own[..., :D], own[..., D:], cap


class Heads(Transport):
    """``comm="heads"`` (Ulysses): an all-to-all over heads gives rank p the whole sequence for query
    heads ``[p·H/W, (p+1)·H/W)`` (and the kv heads they read); needs ``H % W == 0``."""

    name = "heads"

    def attention(self, cp, q, k, v, sched, opts, captured, causal, scale, score_mod, return_lse):
        """All-to-all over heads: rank p gets the whole sequence for query heads [p·H/W, (p+1)·H/W) and
        the kv heads they read; one :func:`attnkit.attention` there; the output goes back by rows."""
        W, r, L = cp.W, cp.rank, cp.seq_len
        B, H = q.shape[:2]
        Hkv = k.shape[1]
        g = H // Hkv
        qr = [(p * H // W, (p + 1) * H // W) for p in range(W)]
        kr = [(a // g, (b - 1) // g + 1) for a, b in qr]
        st = cp.stats = Stats()
        st.tiles_computed = int(sched.tiles.sum())
        st.tiles_skipped = int(sched.empty.sum())
        st.pairs_computed, st.pairs_skipped = W, 0
        st.peers_sent = st.peers_received = tuple(p for p in range(W) if p != r)
        cp.backward_stats = Stats()
        qh = _HeadsToSeq.apply(cp, q, qr, 21)  # (B, H/W, L, D) in global order
        kh = _HeadsToSeq.apply(cp, k, kr, 22)
        vh = _HeadsToSeq.apply(cp, v, kr, 23)
        h0, kh0 = qr[r][0], kr[r][0]
        idx = [(h0 + i) // g - kh0 for i in range(qh.shape[1])]
        if idx != [i // (qh.shape[1] // kh.shape[1]) if qh.shape[1] % kh.shape[1] == 0 else -1
                   for i in range(qh.shape[1])]:
            sel = torch.tensor(idx, device=kh.device)
            kh, vh = kh.index_select(1, sel), vh.index_select(1, sel)  # GQA groups split unevenly here
        base, _ = _options(L, cp.mask, causal, None, None)
        mask = base
        if base is not None and _needs_bh(base):
            gmod = base.bind(L, L)
            mask = _masks.from_mod(lambda b, h, qi, ki: gmod(b, h + h0, qi, ki))
        sm = None
        if score_mod is not None:
            def sm(score, b, h, qi, ki):
                return score_mod(score, b, h + h0, qi, ki)
        err = out = lse = None
        try:
            out, lse = _attention(qh, kh, vh, mask=mask, score_mod=sm, scale=scale, return_lse=True)
            st.steps = 1
        except Exception as e:
            err = e
        cp._status(err, "forward")
        assert out is not None and lse is not None, "_status raised the failure"
        out = _SeqToHeads.apply(cp, out, qr, H, 24)
        if return_lse:  # only then does lse travel back
            lse = _SeqToHeads.apply(cp, lse.unsqueeze(-1), qr, H, 25).squeeze(-1)
        return out, lse

    @staticmethod
    def h2s(cp, x, ranges, tag, st):
        """(B, Hx, L_r, ·) this rank's rows of every head → (B, heads of ranges[rank], L, ·) every row."""
        r, P = cp.rank, cp.layout.positions
        a, b = ranges[r]
        peers = [p for p in range(cp.W) if p != r]
        send = {p: x[:, ranges[p][0]:ranges[p][1]].contiguous() for p in peers}
        recv = {p: x.new_empty(x.shape[0], b - a, len(P[p]), x.shape[3]) for p in peers}
        cp._p2p(send, recv, tag, "head all-to-all")
        st.bytes_sent += sum(t.numel() * t.element_size() for t in send.values())
        st.bytes_received += sum(t.numel() * t.element_size() for t in recv.values())
        parts = [x[:, a:b] if p == r else recv[p] for p in range(cp.W)]
        return torch.cat(parts, 2).index_select(2, cp.layout.inverse.to(x.device))

    @staticmethod
    def s2h(cp, y, ranges, Hx, tag, st):
        """The inverse of :meth:`h2s`: (B, heads of ranges[rank], L, ·) → (B, Hx, L_r, ·), summing
        the contributions of ranks whose head ranges overlap (kv heads shared under MQA)."""
        r, P = cp.rank, cp.layout.positions
        yy = y.index_select(2, cp.layout.order.to(y.device))
        pieces = list(torch.split(yy, cp.layout.lengths, dim=2))
        peers = [p for p in range(cp.W) if p != r]
        send = {p: pieces[p].contiguous() for p in peers}
        recv = {p: y.new_empty(y.shape[0], ranges[p][1] - ranges[p][0], len(P[r]), y.shape[3]) for p in peers}
        cp._p2p(send, recv, tag, "head all-to-all (back)")
        st.bytes_sent += sum(t.numel() * t.element_size() for t in send.values())
        st.bytes_received += sum(t.numel() * t.element_size() for t in recv.values())
        out = y.new_zeros(y.shape[0], Hx, len(P[r]), y.shape[3])
        for p in range(cp.W):
            a, b = ranges[p]
            out[:, a:b] += pieces[r] if p == r else recv[p]
        return out


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp, x, ranges, tag):
        ctx.cp, ctx.ranges, ctx.tag, ctx.Hx = cp, ranges, tag, x.shape[1]
        return Heads.h2s(cp, x.detach(), ranges, tag, cp.stats)

    @staticmethod
    def backward(ctx, g):
        back = Heads.s2h(ctx.cp, g.contiguous(), ctx.ranges, ctx.Hx, ctx.tag + 10, ctx.cp.backward_stats)
        return None, back, None, None


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp, y, ranges, Hx, tag):
        ctx.cp, ctx.ranges, ctx.tag, ctx.call = cp, ranges, tag, cp._calls
        return Heads.s2h(cp, y.detach(), ranges, Hx, tag, cp.stats)

    @staticmethod
    def backward(ctx, g):
        ctx.cp._backward_check(ctx.call)  # the first exchange of a comm='heads' backward (out's, or lse's)
        back = Heads.h2s(ctx.cp, g.contiguous(), ctx.ranges, ctx.tag + 10, ctx.cp.backward_stats)
        return None, back, None, None, None


def _p2p_forward(cp, sched, opts, q, k, v, st, keep: bool):
    """Stream the K/V this rank needs, round by round (:class:`_Stream`), merging each pair's partial
    result as it is computed (:func:`_order`, the simulator's order). Returns ``(out, (c, r), kept,
    error)``: ``kept`` the received K/V when ``keep`` (for the backward), an exception raised by
    the local compute (the communication still runs to the end, so no peer waits forever)."""
    r, P = cp.rank, cp.layout.positions
    D = k.shape[-1]
    stream = _Stream(cp, sched)
    packed = torch.cat([k, v], -1).contiguous() if any(stream.dst(d) is not None for d in stream.rounds) else None
    elt = k.element_size()
    shape = (k.shape[0], k.shape[1])

    def recv_like(s):  # only the key rows this rank's blocks read (sched.span)
        a, b = sched.span(r, s)
        return k.new_empty(*shape, b - a, D + v.shape[-1])

    def send(t):  # the rows of this rank's shard that rank t reads
        a, b = sched.span(t, r)
        assert packed is not None
        return packed[:, :, a:b].contiguous() if (a, b) != (0, packed.shape[2]) else packed

    def post(d):
        return stream.post(d, send, recv_like, _Stream.KV_TAG, "forward K/V stream", stream.dst(d), stream.src(d))

    acc = _acc_dtype(q.dtype)
    res, err, kept = None, None, {r: (k, v)} if sched.visible[r, r] else {}
    sent, received = [], []
    cp._check_alive()
    pending = post(stream.rounds[0]) if stream.rounds else None
    if pending is not None and pending[1] is not None:
        stream.hold(1)
    try:
        if sched.visible[r, r]:
            res = tuple(t.to(acc) for t in _pair(q, k, v, P[r], P[r], sched.blocks(r, r), opts))
    except Exception as e:
        err = e
    for i, d in enumerate(stream.rounds):
        assert pending is not None
        s, buf, works = pending
        stream.wait(works, "forward K/V stream")
        st.bytes_sent += _Stream.sent_bytes(works)
        works = None
        pending = post(stream.rounds[i + 1]) if i + 1 < len(stream.rounds) else None
        if pending is not None and pending[1] is not None:
            stream.hold(1)
        t = stream.dst(d)
        if t is not None and packed is not None:
            sent.append(t)
        if buf is None:
            continue
        received.append(s)
        st.bytes_received += buf.numel() * elt
        if err is None:
            try:
                a, _ = sched.span(r, s)
                part = tuple(x.to(acc) for x in _pair(q, buf[..., :D], buf[..., D:], P[r], P[s][a:],
                                                      sched.blocks(r, s, shift=True), opts))
                res = part if res is None else _merge(res, part)
            except Exception as e:
                err = e
        if keep:
            kept[s] = (buf[..., :D], buf[..., D:])
        else:
            stream.hold(-1)
    st.peers_sent, st.peers_received = tuple(sorted(sent)), tuple(sorted(received))
    st.steps = (1 if sched.visible[r, r] else 0) + len(received)
    st.kv_held_max = stream.held_max
    if res is None and err is None:
        B, H, n = q.shape[:3]
        res = (q.new_zeros(B, H, n, v.shape[-1], dtype=acc), q.new_full((B, H, n), float("-inf"), dtype=acc),
               q.new_zeros((B, H, n), dtype=acc))
    if res is None:
        return None, None, kept, err
    return res[0], (res[1], res[2]), kept, err


def _p2p_backward(cp, sched, opts, q, k, v, ctx, dout, dlse, st):
    """The backward, streamed like the forward: per round, the K/V of rank (r − d) arrives (again,
    unless kept), this rank's (dK, dV) partial for it is computed and sent back, and the partial
    of rank (r + d) for this rank's keys arrives and is added (:func:`_owner_order`). At most two
    received K/V shards and one dK/dV partial each way are alive at once."""
    r, P = cp.rank, cp.layout.positions
    D, Dv = k.shape[-1], v.shape[-1]
    acc = _acc_dtype(q.dtype)
    kept = ctx.kv
    stream = _Stream(cp, sched, held_from=0 if kept is None else sum(1 for s in kept if s != r))
    elt = k.element_size()
    shape = (k.shape[0], k.shape[1])
    # the senders know whether each receiver kept its K/V (the same rule, from the schedule)
    refetch = {d: (stream.dst(d) is not None and not _keeps(cp, sched, stream.dst(d))) for d in stream.rounds}
    packed = torch.cat([k, v], -1).contiguous() if any(refetch.values()) else None

    def kv_send(t):
        a, b = sched.span(t, r)
        assert packed is not None
        return packed[:, :, a:b].contiguous() if (a, b) != (0, packed.shape[2]) else packed

    def kv_like(s):
        a, b = sched.span(r, s)
        return k.new_empty(*shape, b - a, D + Dv)

    def kv_post(d):
        src = stream.src(d) if kept is None else None
        return stream.post(d, kv_send, kv_like, _Stream.KV_TAG, "backward K/V stream",
                           stream.dst(d) if refetch[d] else None, src)

    rows = None
    err = None
    try:
        rows = _RowsBackward(q, P[r], P, opts, ctx.out, ctx.lse2, dout, dlse, list(ctx.captured))
    except Exception as e:
        err = e
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    cp._check_alive()
    pending = kv_post(stream.rounds[0]) if stream.rounds else None
    if pending is not None and pending[1] is not None:
        stream.hold(1)
    if sched.visible[r, r] and rows is not None and err is None:
        try:
            pk, pv = rows.pair(r, k, v, sched.blocks(r, r))
            dk += pk
            dv += pv
        except Exception as e:
            err = e
    steps = 1 if sched.visible[r, r] else 0
    for i, d in enumerate(stream.rounds):
        assert pending is not None
        _, buf, works = pending
        stream.wait(works, "backward K/V stream")
        st.bytes_sent += _Stream.sent_bytes(works)
        works = None
        if buf is not None:
            st.bytes_received += buf.numel() * elt
        pending = kv_post(stream.rounds[i + 1]) if i + 1 < len(stream.rounds) else None
        if pending is not None and pending[1] is not None:
            stream.hold(1)
        s = stream.src(d)
        grad = None
        if s is not None:
            steps += 1
            ks, vs = (buf[..., :D], buf[..., D:]) if buf is not None else kept[s]
            a, b = sched.span(r, s)
            if err is None and rows is not None:
                try:
                    grad = torch.cat(rows.pair(s, ks, vs, sched.blocks(r, s, shift=True), kpos=P[s][a:]), -1)
                    grad = grad.contiguous()
                except Exception as e:
                    err = e
            if grad is None:  # failed here: still answer the owner (the status exchange reports the failure)
                grad = torch.zeros(*shape, b - a, D + Dv, dtype=acc, device=k.device)
        if buf is not None:
            stream.hold(-1)
        t = stream.dst(d)
        def grad_like(t):  # rank t's partial for the rows of this shard it read
            a, b = sched.span(t, r)
            return torch.empty(*shape, b - a, D + Dv, dtype=acc, device=k.device)

        _, gbuf, gworks = stream.post(d, grad, grad_like, _Stream.GRAD_TAG, "backward dK/dV return", s, t)
        stream.wait(gworks, "backward dK/dV return")
        st.bytes_sent += _Stream.sent_bytes(gworks)
        if gbuf is not None:
            st.bytes_received += gbuf.numel() * gbuf.element_size()
            a, b = sched.span(t, r)
            dk[:, :, a:b] += gbuf[..., :D]
            dv[:, :, a:b] += gbuf[..., D:]
    st.steps = steps
    st.kv_held_max = stream.held_max
    cp._status(err, "backward")
    assert rows is not None
    return rows.dq, dk, dv, rows.cap


TRANSPORTS: dict[str, Transport] = {t.name: t for t in (P2P(), AllGather(), Heads())}
