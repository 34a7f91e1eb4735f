"""The user-facing object: :class:`ContextParallel` — validation, signatures, and the call."""

from __future__ import annotations

import math
import struct
import weakref
from datetime import timedelta

import torch

from .. import _mods
from .. import masks as _masks
from .. import plans as _plans
from .._request import check_score_mod
from .guard import (
    _DEAD_GROUPS,
    _DTYPES,
    _FIELDS,
    _HASHED,
    _MSG,
    _REBUILD,
    ContextParallelError,
    _digest,
    _field_text,
    _group_object,
    _short,
)
from .layouts import Layout
from .layouts import layout as _layout
from .pairs import _captured, _check_unsupported, _options
from .schedules import Schedule, _plan_B, _plan_H, schedule
from .stats import Stats
from .transport import TRANSPORTS, Transport


class ContextParallel:
    """Exact attention over a sequence sharded along dim 2 across the ranks of ``group``.

    Args:
        seq_len: the global sequence length L (= S).
        mask: an :mod:`attnkit.masks` mask at global positions (None: full attention).
        layout: "contiguous", "zigzag", "balanced" (see the module docstring), or a :class:`Layout`.
        comm: "p2p" (send K/V only to the ranks that see it), "allgather", or "heads" (Ulysses).
        group: the process group (None: WORLD).
        block: the layout unit and plan tile (default :func:`default_block`).
        timeout: seconds to wait for a peer before raising (None: the group's timeout).
        keep_kv: "auto" (default): a rank that received K/V from one rank keeps it for the backward, one
            that received from several streams them again (memory bounded by two shards, K/V traffic
            ×2); True: keep every received shard (memory: the visible K/V); False: always stream again.
        batch, heads: sizes for a mask whose tiles depend on the batch row / head (an opaque mask_mod).
    """

    def __init__(self, seq_len: int, mask=None, layout="contiguous", *, comm: str = "p2p", group=None,
                 block: int | None = None, timeout: float | None = None, keep_kv: bool | str = "auto",
                 batch: int | None = None, heads: int | None = None):
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ContextParallel: call torch.distributed.init_process_group(...) first.")
        if mask is not None and not isinstance(mask, _masks.Mask):
            if callable(mask):
                mask = _masks.from_mod(mask)
            else:
                raise TypeError(f"mask: expected an attnkit.masks mask, a mask_mod or None, got {type(mask).__name__}.")
        if comm not in TRANSPORTS:
            raise ValueError(f"comm: expected one of {tuple(TRANSPORTS)}, got {comm!r}.")
        seq_len = _plans._check_size("seq_len", seq_len)
        block, batch, heads = (_plans._check_size(name, x, allow_none=True)
                               for name, x in (("block", block), ("batch", batch), ("heads", heads)))
        if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                        and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout: expected None (the process group's timeout) or a finite number of seconds "
                             f"> 0, got {timeout!r}.")
        self.dist, self.group = dist, group
        self.W = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.seq_len, self.mask, self.comm = seq_len, mask, comm
        self.transport: Transport = TRANSPORTS[comm]
        self.timeout = timeout
        if keep_kv not in (True, False, "auto"):
            raise ValueError(f"keep_kv: expected True, False or 'auto', got {keep_kv!r}.")
        self.keep_kv = keep_kv
        self._B, self._H = batch, heads
        if isinstance(layout, Layout):
            if layout.W != self.W or layout.L != seq_len:
                raise ValueError(f"layout: built for W={layout.W}, L={layout.L}; this group has W={self.W}, "
                                 f"seq_len={seq_len}.")
            self.layout = layout
        else:
            self.layout = _layout(layout, seq_len, self.W, mask=mask, block=block, B=batch, H=heads)
        self._scheds: dict[tuple, Schedule] = {}  # of the mask whose content key is _sched_mask
        self._sched_mask: object = None
        self._sched: Schedule | None = None  # the schedule of the call in progress (set by CPFunction)
        self._mask_key: tuple[object, int] | None = None  # (the mask's content key, its digest)
        self._calls = 0
        self._checked_modules: weakref.WeakSet = weakref.WeakSet()  # modules found equal on every rank
        self.stats = Stats()
        self.backward_stats = Stats()

    # ----------------------------------------------------------------- layout helpers
    @property
    def positions(self) -> torch.Tensor:
        """Global positions of this rank's rows (for RoPE, position ids, labels)."""
        return self.layout.positions[self.rank]

    def shard(self, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """This rank's rows of a full-sequence tensor along ``dim`` (autograd-friendly)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"shard: expected size seq_len={self.seq_len} on dim {dim}, got {tuple(x.shape)}.")
        if self.layout.is_contiguous(self.rank):
            p = self.positions
            return x.narrow(dim, int(p[0]), p.numel())
        return x.index_select(dim, self.positions.to(x.device))

    def gather(self, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """All ranks' shards of ``x`` (this rank's rows on ``dim``) in global order, on every rank
        (not differentiable: compute losses on the local shard)."""
        if not isinstance(x, torch.Tensor) or not -x.dim() <= dim < x.dim():
            raise ValueError(f"gather: expected a tensor with this rank's rows on dim {dim}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}.")
        rows = self.layout.lengths[self.rank]
        if x.shape[dim] != rows:
            raise ValueError(f"gather: rank {self.rank} owns {rows} rows, got {tuple(x.shape)} with {x.shape[dim]} on "
                             f"dim {dim}. Pass this rank's shard (cp.shard(x), or a call's output), not the full "
                             "sequence.")
        x = x.detach().movedim(dim, 0).contiguous()
        n = max(self.layout.lengths)
        pad = x.new_zeros((n, *x.shape[1:]))
        pad[:x.shape[0]] = x
        bufs = [torch.empty_like(pad) for _ in range(self.W)]
        self._check_alive()
        self._wait(self._issue(lambda: self.dist.all_gather(bufs, pad, group=self.group, async_op=True), "gather"),
                   None, "gather")
        full = torch.cat([b[:m] for b, m in zip(bufs, self.layout.lengths, strict=True)], 0)  # one per rank
        return full.index_select(0, self.layout.inverse.to(full.device)).movedim(0, dim)

    def schedule(self, B: int = 1, H: int = 1, causal: bool = False) -> Schedule:
        """The :class:`Schedule` (which rank pairs are exchanged and computed) of a call with
        batch ``B``, ``H`` query heads and ``causal`` (cached)."""
        base, _ = _options(self.seq_len, self.mask, causal, None, None)
        key = (bool(causal), _plan_B(base, B), _plan_H(base, H))
        # The tiles are the mask's as it is now: a from_mod over document ids the caller edits in place between
        # calls (a packed batch's next ids) has a new content key, and schedules of the old one are dropped (one
        # content at a time: a training loop's new ids each step do not pile up). A mask with no key (one reading
        # data that cannot be keyed) is scheduled afresh on every call.
        ck = ("no mask",) if self.mask is None else self.mask.cache_key()
        if ck is None:
            return schedule(self.layout, base, B=key[1], H=key[2])
        if ck != self._sched_mask:
            self._scheds.clear()
            self._sched_mask = ck
        if key not in self._scheds:
            self._scheds[key] = schedule(self.layout, base, B=key[1], H=key[2])
        return self._scheds[key]

    # ----------------------------------------------------------------- communication
    def _g(self, r: int) -> int:
        return r if self.group is None else self.dist.get_global_rank(self.group, r)

    def _wait(self, work, peer, what):
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=self.timeout))
        except Exception as e:  # gloo raises RuntimeError on timeout / a closed peer
            who = f"rank {peer}" if peer is not None else "some rank"
            msg = (f"context parallel (rank {self.rank} of {self.W}, call #{self._calls}): no answer from {who} "
                   f"during {what}"
                   f"{'' if self.timeout is None else f' within {self.timeout:g}s'}: it failed, hung or skipped this "
                   f"call. ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            self._mark_dead(msg)
            raise ContextParallelError(msg + " " + _REBUILD) from None

    def _mark_dead(self, why: str):
        pg = _group_object(self.dist, self.group)
        _DEAD_GROUPS.setdefault(id(pg), (pg, why))

    def _check_alive(self):
        """Raise at once on a group that failed before (in any ContextParallel on it)."""
        pg = _group_object(self.dist, self.group)
        dead = _DEAD_GROUPS.get(id(pg))
        if dead is not None and dead[0] is pg:
            raise ContextParallelError(
                f"context parallel (rank {self.rank} of {self.W}): this process group failed earlier and cannot "
                f"be used again ({dead[1]}). {_REBUILD}")

    def _issue(self, op, what, peer=None):
        """Post one communication; a failure to post (a connection gloo closed) is a dead group too."""
        try:
            return op()
        except Exception as e:  # gloo's raw RuntimeError, turned into ours
            who = f" with rank {peer}" if peer is not None else ""
            msg = (f"context parallel (rank {self.rank} of {self.W}, call #{self._calls}): could not communicate"
                   f"{who} during {what} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            self._mark_dead(msg)
            raise ContextParallelError(msg + " " + _REBUILD) from None

    def _p2p(self, send: dict, recv: dict, tag: int, what: str, meanwhile=None):
        """isend ``send[peer]`` and irecv into ``recv[peer]``; every handle waited on, per peer
        (``meanwhile()`` runs while the messages travel)."""
        self._check_alive()
        works = []
        for peer, buf in recv.items():
            works.append((peer, self._issue(lambda buf=buf, peer=peer: self.dist.irecv(buf, src=self._g(peer),
                                                                                       group=self.group, tag=tag),
                                            what, peer), "recv"))
        for peer, t in send.items():
            works.append((peer, self._issue(lambda t=t, peer=peer: self.dist.isend(t, dst=self._g(peer),
                                                                                   group=self.group, tag=tag),
                                            what, peer), "send"))
        if meanwhile is not None:
            try:
                meanwhile()
            finally:
                for peer, w, kind in works:
                    self._wait(w, peer, f"{what} ({kind})")
            return
        for peer, w, kind in works:
            self._wait(w, peer, f"{what} ({kind})")

    def _agree(self, fields: dict, msg: str, what: str):
        """Exchange a signature (fields + status message) with every peer; raise on any mismatch or
        error, on every rank."""
        vals = [int(fields.get(f, 0)) for f in _FIELDS]
        raw = struct.pack(f"<{len(vals)}q", *vals) + msg.encode()[:_MSG].ljust(_MSG, b"\0")
        mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
        peers = [p for p in range(self.W) if p != self.rank]
        bufs = {p: torch.empty_like(mine) for p in peers}
        self._p2p(dict.fromkeys(peers, mine), bufs, 7, what)
        sigs = {self.rank: (vals, msg)}
        for p, b in bufs.items():
            raw = bytes(b.numpy().tobytes())
            v = list(struct.unpack(f"<{len(_FIELDS)}q", raw[:8 * len(_FIELDS)]))
            sigs[p] = (v, raw[8 * len(_FIELDS):].rstrip(b"\0").decode(errors="replace"))
        failed = [(p, m) for p, (v, m) in sorted(sigs.items()) if v[0] != 0]
        if failed:
            p, m = failed[0]
            raise ContextParallelError(f"context parallel {what}, call #{self._calls}: rank {p} failed: {m}"
                                       + (f" (and ranks {[f[0] for f in failed[1:]]})" if len(failed) > 1 else ""))
        ref = sigs[0][0]
        for p in sorted(sigs):
            for name, v0, vp in zip(_FIELDS, ref, sigs[p][0], strict=True):  # every signature has all fields
                if v0 != vp and name != "rows":
                    same = ""
                    shown: tuple[object, object] = (v0, vp)
                    if name in ("causal", "return_lse"):
                        shown = (bool(v0), bool(vp))
                    if name == "keep_kv":
                        names = {0: False, 1: True, 2: "auto"}
                        shown = (names[v0], names[vp])
                    if name in _HASHED:  # show what was hashed
                        shown = (_field_text(sigs[0][1], name), _field_text(sigs[p][1], name))
                        if shown[0] == shown[1]:
                            same = (" — the same description, different contents: a tensor it holds or a value "
                                    "it captures differs between the ranks")
                    if name == "module":
                        raise ContextParallelError(
                            f"context parallel {what}: ranks disagree on the parameters or buffers of "
                            f"{_field_text(sigs[0][1], name)} (rank 0 and rank {p}): each rank would compute with "
                            "other weights (a model built without one seed on every rank draws its own). Give every "
                            "rank rank 0's state first: attnkit.integrations.context_parallel.sync_state(model, cp) "
                            "(or seed every rank alike before building the model).")
                    if name == "call" and what == "backward check":
                        raise ContextParallelError(
                            f"context parallel backward: rank 0 runs the backward of call #{v0}, rank {p} that of call "
                            f"#{vp}: every rank must backpropagate the same calls, in the same order (each rank's dK "
                            "and dV would mix the partials of two calls).")
                    raise ContextParallelError(
                        f"context parallel {what}: ranks disagree on {name}: "
                        f"rank 0 has {shown[0]}, rank {p} has {shown[1]}{same} "
                        f"(every rank must call attention with the same shapes, dtype, options and mask data"
                        f"{'; a rank skipped or repeated a call' if name == 'call' else ''}).")

    def check_module(self, module: torch.nn.Module) -> None:
        """Raise :class:`ContextParallelError` on every rank unless ``module``'s parameters and buffers are the
        same on every rank of the group — once per module, at its first context-parallel call (an ``attnkit.nn``
        layer or block calls it): a model each rank built from its own random draws would otherwise train on other
        weights on every rank, silently. Afterwards the weights stay in step as the ranks' optimizer steps do
        (gradients summed over the group, as data parallelism sums them)."""
        if module in self._checked_modules:
            return
        self._check_alive()
        self._agree({"status": 0, "call": self._calls, "module": _digest(module)},
                    f"module={type(module).__name__}", "module check")
        self._checked_modules.add(module)

    # ----------------------------------------------------------------- the call
    def attention(self, q, k, v, *, causal: bool = False, scale=None, score_mod=None, return_lse: bool = False,
                  **unsupported):
        """Exact attention of this rank's query rows against the whole sequence.

        ``q (B, H, L_r, D)``, ``k (B, Hkv, L_r, D)``, ``v (B, Hkv, L_r, Dv)`` are this rank's rows
        (:meth:`shard`); returns ``out (B, H, L_r, Dv)`` (and ``lse (B, H, L_r)`` with ``return_lse``).
        Options as :func:`attnkit.attention`; every rank must pass the same ones."""
        self._check_alive()
        self._calls += 1
        msg, fields = "", {}
        try:
            _check_unsupported(unsupported)
            fields = self._validate(q, k, v, causal, scale, score_mod, return_lse)
            # readable values of the hashed fields, for a mismatch message (the hashes decide)
            msg = "; ".join(f"{n}={_short(x)}" for n, x in (
                ("dtype", q.dtype), ("scale", scale), ("score_mod", score_mod), ("mask", self.mask),
                ("layout", self.layout), ("comm", self.comm)))
        except Exception as e:  # tell the peers before raising here
            msg = f"{type(e).__name__}: {e}"
            fields = dict(fields, status=1, call=self._calls)
        self._agree(fields, msg, "signature check")
        _, opts = _options(self.seq_len, self.mask, causal, scale, score_mod)
        sched = self.schedule(q.shape[0], q.shape[1], causal)
        captured = _captured(score_mod)
        out, lse = self.transport.attention(self, q, k, v, sched, opts, captured, causal, scale, score_mod,
                                            return_lse)
        return (out, lse) if return_lse else out

    def _validate(self, q, k, v, causal, scale, score_mod, return_lse):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name}: expected a 4-D tensor (B, heads, L_r, dim), got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}.")
        B, H, n, D = q.shape
        Hkv, Dv = k.shape[1], v.shape[-1]
        rows = self.layout.lengths[self.rank]
        fields = dict(status=0, call=self._calls, B=B, H=H, Hkv=Hkv, D=D, Dv=Dv, rows=n,
                      dtype=_DTYPES.index(q.dtype) if q.dtype in _DTYPES else 99, causal=int(bool(causal)),
                      scale=_digest(scale), score_mod=_digest(score_mod),
                      return_lse=int(bool(return_lse)),
                      grad=int(q.requires_grad) + 2 * int(k.requires_grad) + 4 * int(v.requires_grad),
                      layout=self.layout.key, seq_len=self.seq_len, mask=self._mask_digest(),
                      keep_kv=2 if self.keep_kv == "auto" else int(bool(self.keep_kv)),
                      comm=tuple(TRANSPORTS).index(self.comm))
        if n != rows or k.shape[2] != rows or v.shape[2] != rows:
            raise ValueError(f"rank {self.rank} owns {rows} rows under layout {self.layout.name!r}, got q/k/v with "
                             f"{n}/{k.shape[2]}/{v.shape[2]} on dim 2. Pass cp.shard(x) of the full sequence.")
        if k.shape[0] != B or v.shape[0] != B or v.shape[1] != Hkv or k.shape[3] != D or H % Hkv:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q (B, H, L_r, D), "
                             "k (B, Hkv, L_r, D), v (B, Hkv, L_r, Dv) with H % Hkv == 0.")
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
        if self.comm == "heads" and H % self.W:
            raise ValueError(f"comm='heads': the H={H} query heads must split evenly over W={self.W} ranks; "
                             "use comm='p2p' or 'allgather'.")
        if not isinstance(causal, bool):  # a truthy "False" ran as causal
            raise TypeError(f"causal: expected True or False, got {causal!r}.")
        if self.mask is not None:
            self.mask.validate(B, H, self.seq_len, self.seq_len)
        if score_mod is not None:
            check_score_mod(score_mod, self.seq_len, self.seq_len)
        if score_mod is not None and hasattr(score_mod, "validate"):
            score_mod.validate(B, H, self.seq_len, self.seq_len)
        if score_mod is not None and self.comm != "heads" and torch.is_grad_enabled() and n:
            self._check_grad_reach(score_mod, B, H, n, q.dtype)
        return fields

    def _check_grad_reach(self, score_mod, B, H, n, dtype):
        """Refuse a score_mod whose answer carries a gradient to a tensor it reads where attnkit does not look
        (an object's attribute, a list): the exchange's backward delivers gradients to the tensors it found
        (closures, globals, defaults, ``attnkit.score_mods`` tables) and that one would get none, silently. (One
        process runs such a mod on the eager backend instead; ``comm='heads'`` calls one-process attention.)"""
        compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        if _mods.reads_uncaptured_grad(score_mod, _captured(score_mod), (B, H, n, self.seq_len), compute):
            raise ValueError(
                "score_mod: it reads a tensor that requires grad where attnkit does not look for one (an attribute "
                "of an object, an item of a list or dict), and context parallelism could deliver it no gradient. "
                "Capture the tensor itself — bias = holder.bias; score_mod = lambda s, b, h, q, kv: s + bias[kv] — "
                "or use comm='heads'.")

    def _mask_digest(self) -> int:
        """The mask's content digest, reused while the mask's content key (``cache_key()``: a built-in
        mask's immutable value, or a from_mod's code and the bytes of the tensors it reads, taken now)
        is the one it was computed for; recomputed when that key changed (ids edited in place) or when
        the mask has none."""
        ck = None if self.mask is None else self.mask.cache_key()
        if ck is not None and self._mask_key is not None and self._mask_key[0] == ck:
            return self._mask_key[1]
        d = _digest(self.mask)
        self._mask_key = None if ck is None else (ck, d)
        return d

    def _backward_check(self, call: int) -> None:
        """Before a backward's first exchange: every rank backpropagates the same call (``call``, its forward's
        number). A rank running another call's backward would send that call's partials — same shapes, other
        values — and each rank's dK / dV would mix them, silently."""
        self._check_alive()
        self._agree({"status": 0, "call": call}, "", "backward check")

    def _status(self, err, what):
        """After local compute: every rank learns whether any rank failed."""
        msg = "" if err is None else f"{type(err).__name__}: {err}"
        self._agree({"status": int(err is not None), "call": self._calls}, msg, what)
        if err is not None:
            raise err
