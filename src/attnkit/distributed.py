r"""Context parallelism: one exact attention over a sequence sharded across processes.

Shape legend: B batch, H query heads, Hkv key/value heads, L = S = ``seq_len`` (self-attention),
D head dim, Dv value head dim, W world size (ranks of the group), L_r rows owned by rank r::

    q (B, H, L_r, D)   k (B, Hkv, L_r, D)   v (B, Hkv, L_r, Dv)   →   out (B, H, L_r, Dv),  lse (B, H, L_r)

Usage (``torchrun --nproc-per-node 4 train.py``)::

    import torch.distributed as dist, attnkit.distributed as akd
    from attnkit import masks
    dist.init_process_group("gloo")
    cp = akd.ContextParallel(seq_len=L, mask=masks.sliding_window(4096), layout="balanced")
    q, k, v = cp.shard(q), cp.shard(k), cp.shard(v)   # this rank's rows (dim 2)
    out = cp.attention(q, k, v)                       # autograd works; return_lse=True for lse
    full = cp.gather(out)                             # every rank gets (B, H, L, Dv) in global order
    cp.stats                                          # this rank, last forward: bytes, pairs, tiles

**Layouts.** The sequence is cut into *units* of ``block`` positions (the last may be shorter);
a layout gives each rank a sorted set of units, the same for q and k/v. W = 2, L = 16, block = 2
(8 units, ``0``/``1`` = owning rank)::

    contiguous   0 0 0 0 1 1 1 1      rank 0 owns positions 0-7, rank 1 owns 8-15
    zigzag       0 0 1 1 1 1 0 0      2W chunks: rank r holds chunks r and 2W-1-r
    balanced     tokens AND work even: every per-token layer (MLP, projections, loss) waits on
                 the rank with the most positions, attention on the one with the most work.
                 From the plan's per-unit cost (non-empty tiles × their size, partial = ½) the
                 candidates are contiguous cuts (by work; and capped at ⌈n/W⌉ units: equal
                 tokens), zigzag, free greedy, and chunked greedy — chunks of 1-32 consecutive
                 units that see each other (never across a document break), costliest first to
                 the least-loaded rank with room (equal tokens). Of those within 5% of even
                 tokens and 10% of even work, the one whose busiest rank sends least (else the
                 most even work). Causal gets zigzag; a window capped contiguous cuts
                 (neighbours only); packed documents chunks of one document kept together.

**Which pairs are exchanged.** The mask's :class:`attnkit.plans.BlockPlan` at ``block`` tiles
says, for each (query rank r, key rank s), whether r's queries see at least one of s's keys.
Only those pairs are sent and computed. Sliding window under a contiguous layout, W = 4
(``#`` computed, ``.`` neither sent nor computed; the diagonal never travels)::

               keys of rank  0 1 2 3
    queries of rank 0        # . . .
                    1        # # . .        rank 1 receives K/V from rank 0 only,
                    2        . # # .        rank 2 from rank 1 only, ...
                    3        . . # #

Each pair's partial result (out, lse) comes from :func:`attnkit.attention` on the local rows,
with the mask and score_mod evaluated at the **global** positions of those rows; the partial
results of rank r are merged in fp32 (fp64 for fp64 inputs) in ascending key-rank order
(deterministic; independent of W up to rounding), and cast once at the end. The merge carries each
row's lse in two parts, ``lse = c + r`` (``c`` the lse, ``r`` 0 on ordinary rows): on a row whose
every score is a huge finite negative (``finfo.min``, -1e9 padding) the lse rounds to the row max,
so such rows are recomputed with their scores shifted by ``c`` and ``r`` is the exact lse of the
shifted scores — the weights of the merge, and the backward's ``p = exp(s − lse)``, stay exact::

    a row of 16 keys all at finfo.min, W = 4 (4 keys a rank)
    by lse alone:   every lse = finfo.min → weights 1, 1, 1, 1 → out = 4 × mean(V)      (wrong)
    two parts:      c = finfo.min, r = log 4 on each → weights ¼, ¼, ¼, ¼ → out = mean(V)

**Blocks.** Within a pair, each (query run, key run) of consecutive units is one block
(:meth:`Schedule.blocks`): a block whose tiles are all full gets no mask, a run against itself
under a causal mask is plain ``causal=True`` (the fused kernels), the rest evaluates the global
mask at the block's positions. Zigzag under causal has no masked block at all::

    zigzag W = 2, chunks c0..c3; rank 0 owns c0 c3, rank 1 owns c1 c2 (one run)
    pair (0, 0):  c0×c0 causal   c3×c0 full   c3×c3 causal      (c0×c3: empty, skipped)
    pair (0, 1):  c3×(c1 c2) full                               (c0×(c1 c2): empty)
    pair (1, 0):  (c1 c2)×c0 full                               ((c1 c2)×c3: empty)
    pair (1, 1):  (c1 c2)×(c1 c2) causal

**Backward** (an autograd.Function), block by block with the rows' *global* out and lse
(FlashAttention-2's decomposition, ``p = exp(s − lse)``, ``D = rowsum(dout·out)``): full and
causal blocks run torch's fused CPU flash backward directly (no score_mod, D == Dv, fp32/fp64, lse
unused); other blocks are recomputed with autograd and weighted by ``w = exp(lse_block − lse)``.
dq stays local; the dK/dV partials (fp32) go back to the rank that owns those keys, which sums
them in ascending rank order. Only the pairs that were computed travel.

**Modes.** ``comm="p2p"`` (default): point-to-point isend/irecv of exactly the needed K/V
shards (K and V packed in one message, the real Hkv heads only; gloo has no all_to_all); the
local pair is computed while the messages travel. ``comm="allgather"``: every rank all-gathers
all K/V (shards padded to the longest) and all-reduces dK/dV; for short sequences; the compute
still skips invisible pairs. ``comm="heads"`` (Ulysses): an all-to-all over heads (p2p) gives
rank p the whole sequence for query heads ``[p·H/W, (p+1)·H/W)`` (and the kv heads they read),
one :func:`attnkit.attention` runs there, and the output goes back by rows; needs
``H % W == 0``; every rank computes every non-empty tile of its heads::

    before (rows)        after (heads)             W = 2, H = 4
    rank 0: rows 0-7     rank 0: heads 0-1, rows 0-15
    rank 1: rows 8-15    rank 1: heads 2-3, rows 0-15

**Gradients.** q, k, v get exact gradients on their owners. Tensors a score_mod captures (a
learnable ALiBi slope) get this rank's share: sum them over ranks as for any replicated
parameter (DDP does). ``keep_kv=True`` keeps the received K/V for backward (memory: the visible
K/V); ``keep_kv=False`` exchanges them again (traffic ×2, memory: the local shard).

**Faults.** Every call first exchanges a small signature with every peer (shapes, dtypes,
options, layout, call counter), and a status after the local compute. A mismatch, an exception
raised on one rank before or during the compute, or a peer that does not arrive within
``timeout`` seconds gives every participating rank a :class:`ContextParallelError` naming the
rank and what went wrong — never a hang. (A signature costs W − 1 tiny messages per rank.)
The mask, the score_mod and the scale enter the signature by *content* — tensors by their bytes,
functions by their code and every value they capture (closure cells, defaults, the globals they
read), objects by their public attributes — so ranks whose document ids differ by one moved
boundary, whose ALiBi slopes or captured values differ, are refused, not run; ``keep_kv`` and
``seq_len`` are in it too. A timeout or a lost peer leaves the group unusable (messages of that
call stay unmatched): that call and every later one on the group raise a ContextParallelError
saying the group must be rebuilt (``destroy_process_group`` / ``init_process_group``).

**Modules.** ``mha(x, context_parallel=cp)`` / :func:`block_forward` run an
:class:`attnkit.nn.MultiHeadAttention` / :class:`attnkit.nn.TransformerBlock` on a shard ``(B, L_r, E)`` with its
own weights, RoPE at the layout's global positions (:func:`rope_at`) and ALiBi at global positions.
``examples/train_context_parallel.py`` trains a tiny model both ways and prints both loss curves.

**Stats.** ``cp.stats`` (last forward) and ``cp.backward_stats`` (last backward): see :class:`Stats`.
:meth:`ContextParallel.schedule` and :func:`schedule` say which pairs travel, before any call;
``benchmarks/context_parallel.py`` tabulates bytes and balance on paper for W up to 64.

Not supported: ``dropout_p``, ``sinks``, ``return_weights``, bias/tensor masks (give the mask
as an :mod:`attnkit.masks` object at construction), cross-attention (L ≠ S).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
import struct
import types
import zlib
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from . import masks as _masks
from . import plans as _plans
from ._tiling import EMPTY
from .api import attention as _attention
from .backends import _softmax

__all__ = ["ContextParallel", "ContextParallelError", "Layout", "Schedule", "Stats", "layout", "schedule",
           "simulate", "rope_at", "block_forward"]

_LAYOUTS = ("contiguous", "zigzag", "balanced")
_MODES = ("p2p", "allgather", "heads")


class ContextParallelError(RuntimeError):
    """A context-parallel call failed on some rank (mismatch, exception, timeout); raised on every rank."""


_REBUILD = ("The process group must be rebuilt before context parallelism can run again: messages of the failed "
            "call are left unmatched on some ranks. On every rank: torch.distributed.destroy_process_group(), "
            "init_process_group(...) again, and a new ContextParallel.")


# --------------------------------------------------------------------------------------------- layouts

class Layout:
    """Which global positions each rank owns: ``positions[r]`` (sorted long tensor), built from
    units of ``block`` positions. ``owner (L,)`` and ``local (L,)`` invert it."""

    def __init__(self, name: str, L: int, block: int, units: list[list[int]]):
        self.name, self.L, self.block, self.W = name, L, block, len(units)
        self.units = [sorted(u) for u in units]
        self.positions = [torch.cat([torch.arange(u * block, min(L, (u + 1) * block)) for u in us])
                          if us else torch.zeros(0, dtype=torch.long) for us in self.units]
        self.owner = torch.empty(L, dtype=torch.long)
        self.local = torch.empty(L, dtype=torch.long)
        for r, p in enumerate(self.positions):
            self.owner[p] = r
            self.local[p] = torch.arange(p.numel())
        self.order = torch.cat(self.positions)  # concatenated shards -> global position
        self.inverse = torch.argsort(self.order)  # global position -> index in concatenated shards
        self.lengths = [int(p.numel()) for p in self.positions]
        self.key = zlib.crc32(self.owner.to(torch.int32).numpy().tobytes())
        # runs of consecutive units per rank: (first local row, end local row, first unit, end unit)
        self.runs: list[list[tuple[int, int, int, int]]] = []
        for us in self.units:
            runs: list[tuple[int, int, int, int]] = []
            row = 0
            for u in us:
                size = min(L, (u + 1) * block) - u * block
                if runs and runs[-1][3] == u:
                    a, b, ua, _ = runs[-1]
                    runs[-1] = (a, b + size, ua, u + 1)
                else:
                    runs.append((row, row + size, u, u + 1))
                row += size
            self.runs.append(runs)

    def is_contiguous(self, r: int) -> bool:
        p = self.positions[r]
        return p.numel() == 0 or int(p[-1] - p[0]) + 1 == p.numel()

    def draw(self, width: int = 64) -> str:
        """One character per unit: the owning rank (0-9, then a-z)."""
        sym = "0123456789abcdefghijklmnopqrstuvwxyz"
        own = [0] * (-(-self.L // self.block))
        for r, us in enumerate(self.units):
            for u in us:
                own[u] = r
        s = "".join(sym[o % len(sym)] for o in own[:width])
        return s + ("…" if len(own) > width else "")

    def __repr__(self):
        return f"Layout({self.name!r}, L={self.L}, W={self.W}, block={self.block}, rows={self.lengths})"


def _split(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` runs covering n items, the first ``n % parts`` one larger."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _runs(n: int, parts: int) -> list[list[int]]:
    out, start = [], 0
    for size in _split(n, parts):
        out.append(list(range(start, start + size)))
        start += size
    return out


def unit_costs(mask, L: int, block: int, *, B: int | None = None, H: int | None = None,
               max_grid: int = 2048) -> torch.Tensor:
    """Estimated work of each query unit of ``block`` rows: from the plan at the finest tile ``fb``
    dividing ``block`` with at most ``max_grid`` tiles a side (exact when fb = 1),
    Σ over tiles of rows × cols × (1 full, ½ partial, 0 empty), averaged over batch rows / heads."""
    n_units = -(-L // block)
    fb = block
    for cand in range(1, block + 1):  # the finest divisor of block with at most max_grid tiles a side
        if block % cand == 0 and -(-L // cand) <= max_grid:
            fb = cand
            break
    k = _plans.plan(mask, L, L, B=B, H=H, block=fb).kinds  # (Bp, Hp, nq, nk)
    w = (k.to(torch.float32) / 2).mean(dim=(0, 1))  # empty 0, partial 1/2, full 1
    nq = w.shape[0]
    sizes = torch.full((nq,), float(fb))
    sizes[-1] = L - fb * (nq - 1)
    rows_cost = (w @ sizes.to(torch.float32)).double() * sizes.double()  # (nq,)
    unit_of = torch.arange(nq) * fb // block
    return torch.zeros(n_units, dtype=torch.float64).index_add_(0, unit_of, rows_cost)


def _contiguous_cuts(costs: list[float], W: int) -> list[list[int]]:
    """Contiguous runs (each non-empty) minimising the largest run cost (binary search on the bound)."""
    n = len(costs)

    def cuts(bound):
        runs: list[list[int]] = []
        cur: list[int] = []
        tot = 0.0
        for i, c in enumerate(costs):
            left = n - i  # units left including this one
            if cur and (tot + c > bound or left < W - len(runs)):
                runs.append(cur)
                cur, tot = [], 0.0
            cur.append(i)
            tot += c
        runs.append(cur)
        return runs

    lo, hi = max(costs), sum(costs)
    for _ in range(60):
        mid = (lo + hi) / 2
        if len(cuts(mid)) <= W:
            hi = mid
        else:
            lo = mid
    runs = cuts(hi)
    while len(runs) < W:  # split the largest run (only with ties at the bound)
        i = max(range(len(runs)), key=lambda j: len(runs[j]))
        r = runs.pop(i)
        runs[i:i] = [r[:len(r) // 2], r[len(r) // 2:]]
    return runs


def _greedy(costs: list[float], W: int, capacity: int | None = None) -> list[list[int]]:
    """Largest unit first to the least-loaded rank that has room for it (``capacity`` units
    at most: equal rows; None: no limit). Ties: fewest units, then lowest rank."""
    heap = [(0.0, 0, r) for r in range(W)]
    out: list[list[int]] = [[] for _ in range(W)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        full = []
        while True:
            load, cnt, r = heapq.heappop(heap)
            if capacity is None or cnt < capacity:
                break
            full.append((load, cnt, r))
        out[r].append(i)
        heapq.heappush(heap, (load + costs[i], cnt + 1, r))
        for item in full:
            heapq.heappush(heap, item)
    return out


def _capped_cuts(costs: list[float], W: int, cap: int) -> list[list[int]]:
    """Contiguous runs of at most ``cap`` units each (equal tokens when cap = ⌈n/W⌉), minimising the
    largest run's work (binary search on the bound; the greedy cut is optimal for a given bound)."""

    def cuts(bound):
        runs: list[list[int]] = []
        cur: list[int] = []
        tot = 0.0
        for i, c in enumerate(costs):
            if cur and (tot + c > bound or len(cur) >= cap):
                runs.append(cur)
                cur, tot = [], 0.0
            cur.append(i)
            tot += c
        runs.append(cur)
        return runs

    lo, hi = max(costs), sum(costs) + 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if len(cuts(mid)) <= W:
            hi = mid
        else:
            lo = mid
    runs = cuts(hi)
    while len(runs) < W:  # split the longest run
        i = max(range(len(runs)), key=lambda j: (len(runs[j]), -j))
        r = runs.pop(i)
        runs[i:i] = [r[:len(r) // 2], r[len(r) // 2:]]
    return runs


def _chunked_lpt(costs: list[float], live: torch.Tensor, W: int, cap: int, chunk: int) -> list[list[int]]:
    """Equal tokens and even work, keeping neighbours together: the units are cut into chunks of at most
    ``chunk`` consecutive units that see each other (never across a break of the plan: a document
    boundary at a unit edge), and the chunks, costliest first, go to the least-loaded rank with room
    for them (``cap`` units a rank; a chunk that fits nowhere is dealt out unit by unit). O(n·W / chunk)."""
    n = len(costs)
    link = (live.diagonal(1) | live.diagonal(-1)).tolist() if n > 1 else []
    chunks: list[list[int]] = []
    a = 0
    for i in range(n):
        if i == n - 1 or not link[i] or i + 1 - a >= chunk:
            chunks.append(list(range(a, i + 1)))
            a = i + 1
    chunks.sort(key=lambda ch: (-sum(costs[j] for j in ch), ch[0]))
    load, room = [0.0] * W, [cap] * W
    out: list[list[int]] = [[] for _ in range(W)]
    queue, qi = chunks, 0
    while qi < len(queue):
        ch = queue[qi]
        qi += 1
        best = None
        for r in range(W):
            if room[r] >= len(ch) and (best is None or load[r] < load[best]):
                best = r
        if best is None:
            queue[qi:qi] = [[j] for j in ch]
            continue
        out[best].extend(ch)
        load[best] += sum(costs[j] for j in ch)
        room[best] -= len(ch)
    return [sorted(u) for u in out]


def token_imbalance(units: list[list[int]], L: int, block: int) -> float:
    """Busiest rank's positions over the mean (1.0 = perfect): what every per-token layer (MLP,
    projections, loss) waits on."""
    n = -(-L // block)
    rows = [sum(block if i < n - 1 else L - block * (n - 1) for i in us) for us in units]
    return max(rows) / (L / len(units))


def _unit_live(mask, L: int, block: int, B=None, H=None) -> torch.Tensor:
    """(n, n) bool: unit i's queries see at least one key of unit j (for some batch row / head)."""
    n = -(-L // block)
    if mask is None:
        return torch.ones(n, n, dtype=torch.bool)
    kinds = _plans.plan(mask, L, L, B=B, H=H, block=block).kinds
    return (kinds != EMPTY).any(dim=1).any(dim=0)


def _max_sent(units: list[list[int]], live: torch.Tensor, block: int) -> float:
    """The most K/V rows one rank sends under the plan-aware schedule of this assignment."""
    W, n = len(units), live.shape[0]
    own = torch.zeros(W, n, dtype=torch.float64)
    for r, us in enumerate(units):
        own[r, us] = 1.0
    vis = (own @ live.double() @ own.T) > 0  # (W, W): query rank t sees key rank s
    vis.fill_diagonal_(False)
    peers = vis.sum(dim=0)  # per key rank s: ranks that need it
    rows = own.sum(dim=1) * block
    return float((rows * peers).max())


def imbalance(costs, units: list[list[int]]) -> float:
    """Busiest rank's work over the mean (1.0 = perfect)."""
    loads = [sum(float(costs[i]) for i in us) for us in units]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def default_block(L: int, W: int) -> int:
    """Layout unit: about 32 units per rank, at most 4096 units in all."""
    return max(1, -(-L // (32 * W)), -(-L // 4096))


def layout(name: str, L: int, W: int, *, mask=None, block: int | None = None, B: int | None = None,
           H: int | None = None, tolerance: float = 1.10, tokens_tolerance: float = 1.05) -> Layout:
    """Build layout ``name`` ("contiguous", "zigzag", "balanced") of ``L`` positions over ``W`` ranks.

    ``balanced`` needs the mask (None: every query sees every key, so contiguous is balanced).
    """
    if name not in _LAYOUTS:
        raise ValueError(f"layout: expected one of {_LAYOUTS}, got {name!r}.")
    block = default_block(L, W) if block is None else block
    n = -(-L // block)
    need = 2 * W if name == "zigzag" else W
    if n < need:
        raise ValueError(f"layout {name!r}: needs at least {need} units of block={block} for W={W}, but "
                         f"seq_len={L} gives {n}. Pass a smaller block (or use fewer ranks).")
    if name == "contiguous":
        return Layout(name, L, block, _runs(n, W))
    if name == "zigzag":
        chunks = _runs(n, 2 * W)
        return Layout(name, L, block, [chunks[r] + chunks[2 * W - 1 - r] for r in range(W)])
    if mask is None:
        return Layout(name, L, block, _runs(n, W))
    return Layout(name, L, block, _balanced_units(mask, L, W, block, B, H, tolerance, tokens_tolerance))


def _balanced_units(mask, L: int, W: int, block: int, B, H, tolerance: float, tokens_tolerance: float):
    """The "balanced" layout's choice (see the module docstring): candidates that keep tokens within
    ``tokens_tolerance`` of even and work within ``tolerance``; of those, the least traffic on the
    busiest rank (then the most even work). None qualifies: the most even work among those with even
    tokens (equal-token candidates always exist)."""
    n = -(-L // block)
    costs = unit_costs(mask, L, block, B=B, H=H).tolist()
    live = _unit_live(mask, L, block, B, H)
    cap = -(-n // W)
    candidates = [_contiguous_cuts(costs, W),  # the most even work with locality (tokens may be uneven)
                  _capped_cuts(costs, W, cap),  # equal tokens with locality (windows: neighbours only)
                  _greedy(costs, W)]  # the most even work
    if n >= 2 * W:
        zz = _runs(n, 2 * W)
        candidates.append([zz[r] + zz[2 * W - 1 - r] for r in range(W)])  # causal's mirror pairs
    candidates += [_chunked_lpt(costs, live, W, cap, c) for c in (1, 2, 4, 8, 16, 32) if c <= cap]
    scored = [(token_imbalance(c, L, block), imbalance(costs, c), _max_sent(c, live, block), i)
              for i, c in enumerate(candidates)]
    # few units a rank (⌈n/W⌉ against n/W) can make even tokens unreachable: then the most even there is
    tok = max(tokens_tolerance, min(x[0] for x in scored) + 1e-9)
    ok = [x for x in scored if x[0] <= tok and x[1] <= tolerance]
    if ok:
        best = min(ok, key=lambda x: (x[2], x[1], x[3]))
    else:
        best = min((x for x in scored if x[0] <= tok), key=lambda x: (x[1], x[2], x[3]))
    return candidates[best[3]]


# -------------------------------------------------------------------------------------------- schedule

@dataclass
class Schedule:
    """Which (query rank r, key rank s) pairs hold a visible tile, from the plan at the layout's units.

    ``visible (W, W)`` bool; ``full (W, W)``: every tile of the pair is full (no mask needed);
    ``tiles (W, W)`` non-empty tiles; ``empty (W, W)`` empty tiles. ``send_to[s]``: the ranks
    that need s's K/V; ``recv_from[r]``: the ranks whose K/V r needs (both without r itself).
    """
    layout: Layout
    visible: torch.Tensor
    full: torch.Tensor
    tiles: torch.Tensor
    empty: torch.Tensor
    send_to: list = field(default_factory=list)
    recv_from: list = field(default_factory=list)
    unit_live: torch.Tensor | None = None  # (n, n) units
    unit_full: torch.Tensor | None = None
    pure_causal: bool = False
    _blocks: dict = field(default_factory=dict, repr=False)

    #: above this many (query run × key run) blocks a pair is computed as one block
    MAX_BLOCKS = 64

    def blocks(self, r: int, s: int) -> list:
        """The blocks of pair (r, s), in order: ``(qa, qb, ka, kb, kind)`` with local row ranges of
        r's queries and s's keys (one per pair of runs of consecutive units that holds a visible
        tile) and ``kind`` "full" (no mask), "causal" (a run against itself under a causal mask:
        plain ``causal=True``) or "mask" (the global mask at those positions)."""
        key = (r, s)
        if key in self._blocks:
            return self._blocks[key]
        lay = self.layout
        out = []
        live, full = self.unit_live, self.unit_full
        assert live is not None and full is not None, "schedule() builds the unit maps"
        if bool(self.visible[r, s]):
            runs_r, runs_s = lay.runs[r], lay.runs[s]
            if len(runs_r) * len(runs_s) > self.MAX_BLOCKS:
                kind = "full" if bool(self.full[r, s]) else ("causal" if self.pure_causal and r == s else "mask")
                out = [(0, lay.lengths[r], 0, lay.lengths[s], kind)]
            else:
                for qa, qb, ua, ub in runs_r:
                    for ka, kb, va, vb in runs_s:
                        if not bool(live[ua:ub, va:vb].any()):
                            continue
                        if bool(full[ua:ub, va:vb].all()):
                            kind = "full"
                        elif self.pure_causal and r == s and (ua, ub) == (va, vb):
                            kind = "causal"
                        else:
                            kind = "mask"
                        out.append((qa, qb, ka, kb, kind))
        self._blocks[key] = out
        return out

    def row_blocks(self, r: int) -> dict:
        """``{s: blocks(r, s)}`` for every key rank s."""
        return {s: self.blocks(r, s) for s in range(self.layout.W)}

    def rounds(self) -> list[int]:
        """The streaming rounds d (1 ≤ d < W) in which some rank r needs rank (r − d) mod W's keys;
        the others are skipped by every rank (a window under a contiguous layout: round 1 only)."""
        W = self.layout.W
        return [d for d in range(1, W) if any(bool(self.visible[(s + d) % W, s]) for s in range(W))]

    def held(self, keep_kv=False) -> int:
        """On paper: the most received K/V shards any rank holds at once under ``comm="p2p"`` (the one
        computed on and the next in flight; with ``keep_kv`` the kept ones too — ``"auto"`` keeps
        only a single peer's)."""
        W, most = self.layout.W, 0
        for r in range(W):
            n = len(self.recv_from[r])
            keep = n <= 1 if keep_kv == "auto" else bool(keep_kv)
            most = max(most, n if keep else min(n, 2))
        return most


def schedule(lay: Layout, mask, *, B: int | None = None, H: int | None = None) -> Schedule:
    """The :class:`Schedule` of ``mask`` (None: full attention) under ``lay``."""
    W, L, blk = lay.W, lay.L, lay.block
    n = -(-L // blk)
    if mask is None:
        kinds = torch.full((1, 1, n, n), 2, dtype=torch.int8)
    else:
        kinds = _plans.plan(mask, L, L, B=B, H=H, block=blk).kinds
    live = (kinds != EMPTY).any(dim=1).any(dim=0)  # (n, n): non-empty for some batch row / head
    full = (kinds == 2).all(dim=1).all(dim=0)
    own = torch.zeros(W, n, dtype=torch.float64)
    for r, us in enumerate(lay.units):
        own[r, us] = 1.0
    tiles = (own @ live.double() @ own.T).round().long()  # (W, W) non-empty tiles per rank pair
    total = own.sum(1)[:, None] * own.sum(1)[None, :]
    empty = (total - tiles.double()).round().long()
    vis = tiles > 0
    allfull = ((own @ (~full).double() @ own.T) == 0) & vis
    send_to = [[t for t in range(W) if t != s and vis[t, s]] for s in range(W)]
    recv_from = [[s for s in range(W) if s != r and vis[r, s]] for r in range(W)]
    return Schedule(lay, vis, allfull, tiles, empty, send_to, recv_from, live, full,
                    isinstance(mask, _masks.Causal))


# ----------------------------------------------------------------------------------------- pair math

def _block(q, k, v, qpos, kpos, kind, *, gmod, score_mod, scale, pure_causal=False, shift=None):
    """Partial ``(out, lse)`` of local queries at global positions ``qpos`` against keys at ``kpos``
    (one block of a pair, see :meth:`Schedule.blocks`): "full" no mask, "causal" plain causal
    (the same positions on both sides: j ≤ i ⇔ kpos[j] ≤ qpos[i]), "mask" the global mask at those
    positions (a ``from_mod`` on the index maps). A score_mod always sees global positions.
    ``shift (B, H, n)``: subtracted from each row's scores after the score_mod (the softmax is
    unchanged; the lse returned is the block's lse − shift)."""
    mask = None
    causal = kind == "causal"
    if kind == "mask" and gmod is not None:
        def pair_mask(b, h, qi, ki):
            return gmod(b, h, qpos.to(qi.device)[qi], kpos.to(ki.device)[ki])
        mask = _masks.from_mod(pair_mask)
    sm = None
    if score_mod is not None or shift is not None:
        def sm(score, b, h, qi, ki):
            if score_mod is not None:
                score = score_mod(score, b, h, qpos.to(qi.device)[qi], kpos.to(ki.device)[ki])
            return score if shift is None else score - shift.to(score.device, score.dtype)[b, h, qi]
    return _attention(q, k, v, mask=mask, causal=causal, score_mod=sm, scale=scale, return_lse=True)


def _block_exact(q, k, v, qpos, kpos, kind, opts):
    """A block's partial result as ``(out, c, r)``, its lse kept in two parts: ``lse = c + r``.

    Ordinary rows: ``c = lse``, ``r = 0``. A row whose lse is finite and huge (every score near
    ``finfo.min`` or −1e9: a score_mod that pads whole rows) cannot be merged by lse alone, which
    rounds to the row max there (two shards of n keys each would merge with weights 1 and 1, not
    ½ and ½). Such rows are computed again with their scores shifted by ``c`` = the first lse
    (within an ulp of the row max, so the shifted scores are moderate), and ``r`` is the exact lse
    of the shifted scores. The second pass runs only when such rows exist."""
    o, lse = _block(q, k, v, qpos, kpos, kind, **opts)
    bad = _softmax.inexact_rows(lse)
    if not bool(bad.any()):
        return o, lse, torch.zeros_like(lse)
    shift = torch.where(bad, lse, torch.zeros_like(lse)).detach()
    o2, l2 = _block(q, k, v, qpos, kpos, kind, **opts, shift=shift)
    return o2, torch.where(bad, shift, l2), torch.where(bad, l2, torch.zeros_like(l2))


def _merge(a, b):
    """Merge two partials ``(out, c, r)`` (``lse = c + r``, :func:`_block_exact`) of the same rows over
    disjoint keys, exact on rows of huge finite scores too: with ``c = max(c_a, c_b)`` the weights
    are ``exp((c_a − c) + r_a)`` and ``exp((c_b − c) + r_b)``. A dead side (``c = −inf``) contributes
    nothing; both dead: out 0, c −inf, r 0."""
    out_a, c_a, r_a = a
    out_b, c_b, r_b = b
    c = torch.maximum(c_a, c_b)
    cg = _softmax.guard(c)
    e_a, e_b = (c_a - cg) + r_a, (c_b - cg) + r_b
    top = _softmax.guard(torch.maximum(e_a, e_b))  # exp() stays in range whatever the r's are
    w_a, w_b = (e_a - top).exp(), (e_b - top).exp()
    tot = w_a + w_b
    safe = torch.where(tot > 0, tot, torch.ones_like(tot))
    out = out_a * (w_a / safe).unsqueeze(-1) + out_b * (w_b / safe).unsqueeze(-1)
    r = torch.where(torch.isneginf(c), torch.zeros_like(c), top + torch.log(safe))
    return out, c, r


def _pair(q, k, v, qpos, kpos, blocks, opts):
    """Partial ``(out, c, r)`` of a pair (``lse = c + r``, :func:`_block_exact`) from its blocks: one
    block is returned as it is; several are merged per query run in key order (fp32) and placed in
    their rows (rows seeing no block: 0, -inf, 0)."""
    if len(blocks) == 1 and blocks[0][:4] == (0, q.shape[2], 0, k.shape[2]):
        return _block_exact(q, k, v, qpos, kpos, blocks[0][4], opts)
    acc = _acc_dtype(q.dtype)
    B, H, n = q.shape[:3]
    out = q.new_zeros(B, H, n, v.shape[-1], dtype=acc)
    c = q.new_full((B, H, n), float("-inf"), dtype=acc)
    r = q.new_zeros((B, H, n), dtype=acc)
    cur = None
    for qa, qb, ka, kb, kind in [*blocks, (None,) * 5]:
        if cur is not None and (qa, qb) != cur[:2]:
            out[:, :, cur[0]:cur[1]], c[:, :, cur[0]:cur[1]], r[:, :, cur[0]:cur[1]] = cur[2]
            cur = None
        if qa is None:
            break
        part = _block_exact(q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb], qpos[qa:qb], kpos[ka:kb], kind, opts)
        part = tuple(t.to(acc) for t in part)
        cur = (qa, qb, part if cur is None else _merge(cur[2], part))
    return out, c, r


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rank_forward(q, kv: dict, rank: int, qpos, positions, blocks: dict, opts, partials=None, Dv=None):
    """Merge the partial results of the key ranks in ``kv`` for the queries of ``rank``, in the order
    they stream in (:func:`_order`; ``partials``: those already computed, e.g. the local pair).
    Returns ``(out, c, r)``: the rows' lse is ``c + r``, kept in two parts (:func:`_block_exact`)."""
    acc = _acc_dtype(q.dtype)
    partials = dict(partials or {})
    res = None
    for s in _order(rank, len(positions)):
        if s not in kv:
            continue
        if s not in partials:
            partials[s] = _pair(q, kv[s][0], kv[s][1], qpos, positions[s], blocks[s], opts)
        part = tuple(t.to(acc) for t in partials.pop(s))
        res = part if res is None else _merge(res, part)
    if res is None:  # no visible key at all
        B, H, n = q.shape[0], q.shape[1], q.shape[2]
        Dv = next(iter(kv.values()))[1].shape[-1] if kv else (q.shape[-1] if Dv is None else Dv)
        res = (q.new_zeros(B, H, n, Dv, dtype=acc), q.new_full((B, H, n), float("-inf"), dtype=acc),
               q.new_zeros((B, H, n), dtype=acc))
    return res


def _block_backward_fused(q, k, v, kind, opts, out, lse_b, dout):
    """FlashAttention-2's decomposition on torch's CPU flash backward kernel: given the rows'
    *global* ``out`` and ``lse`` (+inf on dead rows), the kernel's ``p = exp(s - lse)`` and
    ``D = rowsum(dout·out)`` make its (dq, dk, dv) exactly this block's share. For "full" and
    "causal" blocks with no score_mod, D == Dv, fp32/fp64 and no gradient on lse; None otherwise
    (the caller recomputes the block with autograd)."""
    from .backends import _flash_cpu
    causal = kind == "causal"
    if kind not in ("full", "causal") or opts["score_mod"] is not None or q.shape[-1] != v.shape[-1]:
        return None
    if q.dtype not in (torch.float32, torch.float64) or out.dtype != q.dtype or q.device.type != "cpu":
        return None
    if not _flash_cpu.available():
        return None
    B, H, n, D = q.shape
    Hkv, m = k.shape[1], k.shape[2]
    g = H // Hkv
    scale = opts["scale"] if opts["scale"] is not None else 1.0 / math.sqrt(D)
    def c(t):
        return t.contiguous()

    if g == 1 or causal:  # causal rows cannot be folded (the kernel's diagonal would move): expand K/V
        kk = k if g == 1 else k.repeat_interleave(g, dim=1)
        vv = v if g == 1 else v.repeat_interleave(g, dim=1)
        dq, dk, dv = _flash_cpu.backward(c(dout), c(q), c(kk), c(vv), c(out), lse_b.contiguous(), is_causal=causal,
                                         scale=scale)
        if g > 1:
            dk = dk.reshape(B, Hkv, g, m, D).sum(2)
            dv = dv.reshape(B, Hkv, g, m, v.shape[-1]).sum(2)
        return dq, dk, dv
    def fold(t):  # the g query heads of a kv head as rows
        return t.contiguous().view(B, Hkv, g * n, t.shape[-1])

    dq, dk, dv = _flash_cpu.backward(fold(dout), fold(q), c(k), c(v), fold(out),
                                     lse_b.contiguous().view(B, Hkv, g * n), scale=scale)
    return dq.reshape(B, H, n, D), dk, dv


class _RowsBackward:
    """The backward of one rank's query rows, one key rank's pair at a time (:meth:`pair`), so the
    pairs can stream through in any order: dq and the captured tensors' gradients accumulate here.

    Block by block: the fused FA2 kernel where it applies, else the block recomputed with autograd
    and weighted by the global lse (``w = exp(lse_block - lse)``: its share of each row).
    ``lse2 = (c, r)``: the rows' lse in two parts (:func:`_block_exact`); a block holding rows of
    huge finite lse is recomputed with those rows' scores shifted by ``c``, so its share is
    ``exp(lse_shifted − r)``, exact."""

    def __init__(self, q, qpos, positions, opts, out, lse2, dout, dlse, captured):
        self.acc = acc = _acc_dtype(q.dtype)
        self.q, self.qpos, self.positions, self.opts, self.out = q, qpos, positions, opts, out
        self.c_all, self.r_all = lse2
        self.lse_b = _softmax.lse_for_backward(self.c_all + self.r_all)
        self.bad = _softmax.inexact_rows(self.c_all)
        self.dout = dout.to(acc) if dout is not None else torch.zeros_like(out)
        self.dlse, self.captured = dlse, captured
        self.dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        self.cap: list[torch.Tensor | None] = [None] * len(captured)

    def pair(self, s: int, k_s, v_s, blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (dk, dv) partial for key rank ``s`` (acc dtype); adds to dq and the captured grads."""
        acc, q, opts, dq, dlse = self.acc, self.q, self.opts, self.dq, self.dlse
        dk = torch.zeros(k_s.shape, dtype=acc, device=k_s.device)
        dv = torch.zeros(v_s.shape, dtype=acc, device=v_s.device)
        for qa, qb, ka, kb, kind in blocks:
            qs, ks, vs = q[:, :, qa:qb], k_s[:, :, ka:kb], v_s[:, :, ka:kb]
            o_g, l_g, d_g = self.out[:, :, qa:qb], self.lse_b[:, :, qa:qb], self.dout[:, :, qa:qb]
            b_g = self.bad[:, :, qa:qb]
            shifted = bool(b_g.any())
            fast = None if dlse is not None or shifted else _block_backward_fused(qs, ks, vs, kind, opts, o_g, l_g,
                                                                                   d_g)
            if fast is not None:
                dq[:, :, qa:qb] += fast[0].to(acc)
                dk[:, :, ka:kb] += fast[1].to(acc)
                dv[:, :, ka:kb] += fast[2].to(acc)
                continue
            kpos = self.positions[s][ka:kb]
            with torch.enable_grad():
                qq, kk, vv = (t.detach().requires_grad_() for t in (qs, ks, vs))
                base = l_g
                if shifted:
                    shift = torch.where(b_g, self.c_all[:, :, qa:qb], torch.zeros_like(l_g))
                    o, l = _block(qq, kk, vv, self.qpos[qa:qb], kpos, kind, **opts, shift=shift)
                    base = torch.where(b_g, self.r_all[:, :, qa:qb], l_g)
                else:
                    o, l = _block(qq, kk, vv, self.qpos[qa:qb], kpos, kind, **opts)
                w = torch.exp(l.detach().to(acc) - base)  # this block's share of each row (0 on dead rows)
                g_l = w * (d_g * (o.detach().to(acc) - o_g)).sum(-1)
                if dlse is not None:
                    g_l = g_l + w * dlse[:, :, qa:qb].to(acc)
                g_o = d_g * w.unsqueeze(-1)
                grads = torch.autograd.grad([o, l], [qq, kk, vv, *self.captured],
                                            [g_o.to(o.dtype), g_l.to(l.dtype)], allow_unused=True)
            for t, g, sl in ((dq, grads[0], (qa, qb)), (dk, grads[1], (ka, kb)), (dv, grads[2], (ka, kb))):
                if g is not None:
                    t[:, :, sl[0]:sl[1]] += g.to(acc)
            for i, g in enumerate(grads[3:]):
                if g is not None:
                    prev = self.cap[i]
                    self.cap[i] = g if prev is None else prev + g
        return dk, dv


def _order(r: int, W: int) -> list[int]:
    """The key ranks of query rank r in the order their K/V stream in (and their partial results
    are merged): r itself, then round d = 1, 2, … brings rank (r − d) mod W."""
    return [(r - d) % W for d in range(W)]


def _owner_order(s: int, W: int) -> list[int]:
    """The order in which key rank s sums the dK/dV partials sent back to it: its own, then round d
    brings rank (s + d) mod W's."""
    return [(s + d) % W for d in range(W)]


def _rank_backward(q, kv: dict, rank: int, qpos, positions, blocks: dict, opts, out, lse2, dout, dlse, captured):
    """dq of this rank, the (dk, dv) partials for each key rank in ``kv`` (acc dtype), and the
    gradients of the score_mod's captured tensors (local share), pairs in :func:`_order`."""
    rows = _RowsBackward(q, qpos, positions, opts, out, lse2, dout, dlse, captured)
    parts = {}
    for s in _order(rank, len(positions)):
        if s in kv:
            parts[s] = rows.pair(s, kv[s][0], kv[s][1], blocks[s])
    return rows.dq, parts, rows.cap


def _options(seq_len, mask, causal, scale, score_mod):
    base = mask
    if causal:
        base = _masks.causal() if base is None else (base & _masks.causal())
    gmod = None if base is None else base.bind(seq_len, seq_len)
    # with L = S both alignments of causal are the same mask
    return base, dict(gmod=gmod, score_mod=score_mod, scale=scale, pure_causal=isinstance(base, _masks.Causal))


_UNSUPPORTED = {"dropout_p": 0.0, "sinks": None, "return_weights": False, "mask": None, "backend": "auto"}


def _check_unsupported(kw):
    """Refuse the single-process options context parallelism does not take (defaults pass)."""
    extra = sorted(set(kw) - set(_UNSUPPORTED))
    if extra:
        raise TypeError(f"attention: unexpected keyword(s) {extra}.")
    for name, value in kw.items():
        default = _UNSUPPORTED[name]
        same = value is default if default is None or isinstance(default, bool) else (
            isinstance(value, (int, float, str)) and not isinstance(value, bool) and value == default)
        if not same:
            raise ValueError(f"{name}: not supported by context-parallel attention (got {value!r}); the mask "
                             "is fixed at construction (ContextParallel(mask=...)); dropout, sinks, weights and "
                             "named backends are single-process options.")


def _captured(score_mod):
    if score_mod is None:
        return []
    if hasattr(score_mod, "tensors"):
        return [t for t in score_mod.tensors() if isinstance(t, torch.Tensor) and t.requires_grad]
    from . import _mods
    return _mods.captured_grad_tensors(score_mod)


# ---------------------------------------------------------------------------------------- simulation

class _SimFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lay, sched, opts, q, k, v, *captured):
        ctx.set_materialize_grads(False)
        W, P = lay.W, lay.positions
        outs, lses, saved = [], [], []
        for r in range(W):
            qr = q.index_select(2, P[r])
            kv = {s: (k.index_select(2, P[s]), v.index_select(2, P[s])) for s in range(W) if sched.visible[r, s]}
            o, c, rr = _rank_forward(qr, kv, r, P[r], P, sched.row_blocks(r), opts, Dv=v.shape[-1])
            outs.append(o)
            lses.append((c, rr))
            saved.append((qr, kv))
        out = torch.cat(outs, 2).index_select(2, lay.inverse)
        lse = torch.cat([c + rr for c, rr in lses], 2).index_select(2, lay.inverse)
        ctx.lay, ctx.sched, ctx.opts, ctx.saved, ctx.outs, ctx.lses = lay, sched, opts, saved, outs, lses
        ctx.shapes = (q, k, v)
        ctx.captured = captured
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        lay, sched, opts = ctx.lay, ctx.sched, ctx.opts
        q, k, v = ctx.shapes
        W, P = lay.W, lay.positions
        acc = _acc_dtype(q.dtype)
        dqs = []
        parts_by_owner: list[dict] = [{} for _ in range(W)]
        capg: list[torch.Tensor | None] = [None] * len(ctx.captured)
        for r in range(W):
            qr, kv = ctx.saved[r]
            dq, parts, cap = _rank_backward(qr, kv, r, P[r], P, sched.row_blocks(r), opts, ctx.outs[r], ctx.lses[r],
                                            None if dout is None else dout.index_select(2, P[r]),
                                            None if dlse is None else dlse.index_select(2, P[r]),
                                            list(ctx.captured))
            dqs.append(dq)
            for s, pr in parts.items():
                parts_by_owner[s][r] = pr
            for i, g in enumerate(cap):
                if g is not None:
                    capg[i] = g if capg[i] is None else capg[i] + g
        dks, dvs = [], []
        for s in range(W):
            dk, dv = _sum_parts(parts_by_owner[s], k.index_select(2, P[s]), v.index_select(2, P[s]), acc, s, W)
            dks.append(dk)
            dvs.append(dv)
        def cat(xs, like):
            return torch.cat(xs, 2).index_select(2, lay.inverse).to(like.dtype)

        return (None, None, None, cat(dqs, q), cat(dks, k), cat(dvs, v), *capg)


def _sum_parts(parts: dict, k_own, v_own, acc, owner: int, W: int):
    """The owner's dK, dV: its partials summed in the order they stream back (:func:`_owner_order`)."""
    dk = torch.zeros(k_own.shape, dtype=acc, device=k_own.device)
    dv = torch.zeros(v_own.shape, dtype=acc, device=v_own.device)
    for t in (t for t in _owner_order(owner, W) if t in parts):
        dk += parts[t][0]
        dv += parts[t][1]
    return dk, dv


def simulate(q, k, v, *, W: int, layout="contiguous", mask=None, causal=False, scale=None, score_mod=None,
             return_lse=False, block=None):
    """Context-parallel attention over ``W`` *virtual* ranks in one process: the same layout,
    schedule, pair math and merge order as :class:`ContextParallel`, on full tensors
    ``q (B, H, L, D)`` etc.; returns the full result in global order (autograd works).
    ``layout`` is a name or a :class:`Layout`."""
    L = q.shape[2]
    if k.shape[2] != L:
        raise ValueError(f"k: context parallelism is self-attention (S = L = {L}), got S={k.shape[2]}.")
    base, opts = _options(L, mask, causal, scale, score_mod)
    if score_mod is not None and hasattr(score_mod, "validate"):
        score_mod.validate(q.shape[0], q.shape[1], L, L)
    lay = layout if isinstance(layout, Layout) else globals()["layout"](
        layout, L, W, mask=base, block=block, B=_plan_B(base, q.shape[0]), H=None)
    sched = schedule(lay, base, B=_plan_B(base, q.shape[0]), H=_plan_H(base, q.shape[1]))
    out, lse = _SimFn.apply(lay, sched, opts, q, k, v, *_captured(score_mod))
    return (out, lse) if return_lse else out


def _plan_B(mask, B):
    return None if mask is None else (mask.batch_size or (B if _needs_bh(mask) else None))


def _plan_H(mask, H):
    return H if mask is not None and _needs_bh(mask) else None


def _needs_bh(mask) -> bool:
    """Whether the tile map may depend on the batch row / head (an opaque mask_mod somewhere)."""
    if isinstance(mask, _masks.FromMod):
        return True
    return any(_needs_bh(p) for p in getattr(mask, "parts", ()))


# ---------------------------------------------------------------------------------------- processes

@dataclass
class Stats:
    """This rank's last forward (``stats``) or backward (``backward_stats``) call.

    ``steps``: partial results computed and merged (pairs, the local one included);
    ``bytes_sent`` / ``bytes_received``: K/V (forward) or K/V + dK/dV (backward) payload bytes of this
    rank (all_gather/all_reduce: the bytes this rank's shard contributes to / receives from the others);
    ``tiles_computed`` / ``tiles_skipped``: non-empty / empty tiles (the layout's ``block`` grid) of this
    rank's query rows; ``pairs_computed`` / ``pairs_skipped``: key ranks computed / skipped;
    ``peers_sent`` / ``peers_received``: ranks this one sent to / received from;
    ``kv_held_max``: the most received K/V shards this rank held at once (counted where they are
    allocated and freed: ≤ 2 under ``comm="p2p"`` unless K/V are kept for the backward)."""
    steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    tiles_computed: int = 0
    tiles_skipped: int = 0
    pairs_computed: int = 0
    pairs_skipped: int = 0
    peers_sent: tuple = ()
    peers_received: tuple = ()
    kv_held_max: int = 0


_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Compared in this order, so the first difference named is the root one: a rank with another
# seq_len is told that, not that its layout (which follows from it) differs.
_FIELDS = ("status", "call", "seq_len", "layout", "B", "H", "Hkv", "D", "Dv", "rows", "dtype", "causal", "scale",
           "score_mod", "mask", "keep_kv", "return_lse", "grad", "comm")
_MSG = 384
_HASHED = ("dtype", "scale", "score_mod", "mask", "layout", "comm")


def _field_text(message: str, name: str) -> str:
    """The ``name=...`` part of a signature's description (what was hashed), or all of it."""
    return next((x.strip() for x in message.split("; ") if x.strip().startswith(name + "=")), message)


# ------------------------------------------------------------------------- content digests
# A signature compared across ranks must be made of what decides the answer (DESIGN, "Caching and
# signatures"): two document masks with one boundary moved have the same repr, two closures of
# one function the same name. So the mask and the score_mod are hashed by content: tensors by
# their bytes, functions by their code and every value they capture, objects by their public
# attributes (private ones are derived caches, e.g. a mask's per-device copies). Issue 18, item 4.

_DIGEST_DEPTH = 8


def _digest(obj) -> int:
    """A signed 64-bit digest of ``obj``'s content (equal on every rank iff the content is)."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, obj, 0, set())
    return int.from_bytes(h.digest(), "little", signed=True)


def _tag(h, *parts):
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\0")


def _feed(h, x, depth, active):
    if x is None or isinstance(x, (bool, int, str, bytes, complex)):
        return _tag(h, type(x).__name__, repr(x))  # a scalar's repr is its value
    if isinstance(x, float):
        return _tag(h, "float", x.hex())
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous()
        _tag(h, "tensor", t.dtype, tuple(t.shape))
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # any dtype, bf16 included
        return None
    if type(x).__module__ == "numpy" and type(x).__name__ == "ndarray":  # numpy arrays, without importing numpy
        _tag(h, "ndarray", x.dtype, x.shape)
        h.update(x.tobytes())  # C order, whatever the strides
        return None
    if isinstance(x, (types.ModuleType, type)):
        return _tag(h, "named", getattr(x, "__module__", ""), getattr(x, "__qualname__", getattr(x, "__name__", "")))
    if isinstance(x, types.BuiltinFunctionType):
        return _tag(h, "builtin", getattr(x, "__module__", ""), x.__qualname__)
    if depth >= _DIGEST_DEPTH or id(x) in active:
        return _tag(h, "deep" if depth >= _DIGEST_DEPTH else "cycle", type(x).__qualname__)
    active.add(id(x))
    try:
        _feed_container(h, x, depth + 1, active)
    finally:
        active.discard(id(x))
    return None


def _feed_container(h, x, depth, active):
    if isinstance(x, (list, tuple)):
        _tag(h, type(x).__name__, len(x))
        for y in x:
            _feed(h, y, depth, active)
    elif isinstance(x, dict):
        _tag(h, "dict", len(x))
        for key in sorted(x, key=repr):
            _feed(h, key, depth, active)
            _feed(h, x[key], depth, active)
    elif isinstance(x, (set, frozenset)):
        _tag(h, "set", len(x))
        for d in sorted(_digest(y) for y in x):
            _tag(h, d)
    elif isinstance(x, types.CodeType):  # the code itself, not where it was defined
        _tag(h, "code", x.co_name, x.co_argcount, x.co_names, x.co_varnames)
        h.update(x.co_code)
        _feed(h, x.co_consts, depth, active)
    elif isinstance(x, functools.partial):
        _tag(h, "partial")
        for part in (x.func, x.args, x.keywords):
            _feed(h, part, depth, active)
    elif isinstance(x, types.MethodType):
        _tag(h, "method")
        _feed(h, x.__func__, depth, active)
        _feed(h, x.__self__, depth, active)
    elif isinstance(x, types.FunctionType):
        _tag(h, "function")
        _feed(h, x.__code__, depth, active)
        cells = []
        for c in x.__closure__ or ():
            try:
                cells.append(c.cell_contents)
            except ValueError:  # an empty cell
                cells.append("<empty cell>")
        _feed(h, cells, depth, active)
        _feed(h, (x.__defaults__, x.__kwdefaults__), depth, active)
        g = x.__globals__  # the globals its code reads (a tensor of document ids, a window size)
        _feed(h, {n: g[n] for n in x.__code__.co_names if n in g}, depth, active)
        _feed(h, dict(vars(x)), depth, active)
    elif isinstance(x, torch.nn.Module):
        _tag(h, "module", type(x).__module__, type(x).__qualname__)
        _feed(h, dict(x.state_dict()), depth, active)
    else:  # an object (a mask, a score_mod, a callable): its type and attributes
        _tag(h, "object", type(x).__module__, type(x).__qualname__)
        attrs = getattr(x, "__dict__", None)
        if attrs is not None:
            # attnkit's masks keep their data private (Document's ids, Padding's lengths: copies the
            # caller cannot change) and no lazy cache in __dict__, so every attribute is content;
            # another object's private attributes may be caches filled on some ranks only.
            whole = isinstance(x, _masks.Mask)
            _feed(h, {k: v for k, v in attrs.items() if whole or not k.startswith("_")}, depth, active)
        call = getattr(type(x), "__call__", None)  # noqa: B004 - reads the method's code, not a callability test
        if isinstance(call, types.FunctionType):
            _feed(h, call.__code__, depth, active)


# -------------------------------------------------------------------- dead process groups
# After a timeout or a lost peer, a group has messages left unmatched and gloo closes its
# connections: every later collective fails with gloo's own RuntimeError, or worse, matches a
# stale message. The group is recorded here (held, so its id is not reused) and every later call
# on it says so at once.
_DEAD_GROUPS: dict = {}


def _group_object(dist, group):
    return group if group is not None else dist.group.WORLD


def _short(x, n: int = 48) -> str:
    """A readable value for a mismatch message (never compared: the digests are), without "; "."""
    s = repr(x).replace("; ", ", ")
    return s if len(s) <= n else s[:n - 1] + "…"


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
        if comm not in _MODES:
            raise ValueError(f"comm: expected one of {_MODES}, got {comm!r}.")
        self.dist, self.group = dist, group
        self.W = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.seq_len, self.mask, self.comm = seq_len, mask, comm
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
            self.layout = globals()["layout"](layout, seq_len, self.W, mask=mask, block=block, B=batch, H=heads)
        self._scheds: dict[tuple, Schedule] = {}
        self._sched: Schedule | None = None  # the schedule of the call in progress (set by _CPFn)
        self._mask_key: int | None = None
        self._calls = 0
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
                    raise ContextParallelError(
                        f"context parallel {what}: ranks disagree on {name}: "
                        f"rank 0 has {shown[0]}, rank {p} has {shown[1]}{same} "
                        f"(every rank must call attention with the same shapes, dtype, options and mask data"
                        f"{'; a rank skipped or repeated a call' if name == 'call' else ''}).")

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
        if self.comm == "heads":
            out, lse = self._heads_attention(q, k, v, sched, causal, scale, score_mod, return_lse)
        else:
            out, lse = _CPFn.apply(self, sched, opts, q, k, v, *captured)
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
                      keep_kv=2 if self.keep_kv == "auto" else int(bool(self.keep_kv)), comm=_MODES.index(self.comm))
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
        if self.mask is not None:
            self.mask.validate(B, H, self.seq_len, self.seq_len)
        if score_mod is not None and hasattr(score_mod, "validate"):
            score_mod.validate(B, H, self.seq_len, self.seq_len)
        return fields

    def _mask_digest(self) -> int:
        """The mask's content digest: kept for a mask whose content cannot change (built-in masks copy
        their data; ``cache_key()`` says so), recomputed per call for one that reads data (a from_mod
        closing over a tensor the caller may change in place)."""
        if self._mask_key is None or self.mask is None or self.mask.cache_key() is None:
            d = _digest(self.mask)
            if self.mask is not None and self.mask.cache_key() is not None:
                self._mask_key = d
            return d
        return self._mask_key

    def _exchange_kv(self, k, v, what, stats, meanwhile=None):
        """``comm="allgather"``: this rank's view ``{s: (k_s, v_s)}`` of the K/V shards it needs (its
        own included), every shard all-gathered (padded to the longest). ``comm="p2p"`` streams
        instead (:func:`_p2p_forward`)."""
        sched, r, P = self._sched, self.rank, self.layout.positions
        assert sched is not None, "_CPFn sets the call's schedule first"
        D = k.shape[-1]
        kv = {r: (k, v)} if sched.visible[r, r] else {}
        packed = torch.cat([k.detach(), v.detach()], -1).contiguous()
        elt = packed.element_size()
        n = max(self.layout.lengths)
        pad = packed.new_zeros(packed.shape[0], packed.shape[1], n, packed.shape[3])
        pad[:, :, :packed.shape[2]] = packed
        bufs = [torch.empty_like(pad) for _ in range(self.W)]
        self._check_alive()
        work = self._issue(lambda: self.dist.all_gather(bufs, pad, group=self.group, async_op=True), what)
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            self._wait(work, None, what)
        recv = {s: bufs[s][:, :, :len(P[s])] for s in range(self.W) if s != r}
        stats.bytes_sent += pad.numel() * elt * (self.W - 1)
        stats.bytes_received += pad.numel() * elt * (self.W - 1)
        stats.peers_sent = stats.peers_received = tuple(s for s in range(self.W) if s != r)
        for s, buf in recv.items():
            if sched.visible[r, s]:
                kv[s] = (buf[..., :D], buf[..., D:])
        return kv

    # ----------------------------------------------------------------- heads (Ulysses)
    def _heads_attention(self, q, k, v, sched, causal, scale, score_mod, return_lse):
        """All-to-all over heads: rank p gets the whole sequence for query heads [p·H/W, (p+1)·H/W) and
        the kv heads they read; one :func:`attnkit.attention` there; the output goes back by rows."""
        W, r, L = self.W, self.rank, self.seq_len
        B, H = q.shape[:2]
        Hkv = k.shape[1]
        g = H // Hkv
        qr = [(p * H // W, (p + 1) * H // W) for p in range(W)]
        kr = [(a // g, (b - 1) // g + 1) for a, b in qr]
        st = self.stats = Stats()
        st.tiles_computed = int(sched.tiles.sum())
        st.tiles_skipped = int(sched.empty.sum())
        st.pairs_computed, st.pairs_skipped = W, 0
        st.peers_sent = st.peers_received = tuple(p for p in range(W) if p != r)
        self.backward_stats = Stats()
        qh = _HeadsToSeq.apply(self, q, qr, 21)  # (B, H/W, L, D) in global order
        kh = _HeadsToSeq.apply(self, k, kr, 22)
        vh = _HeadsToSeq.apply(self, v, kr, 23)
        h0, kh0 = qr[r][0], kr[r][0]
        idx = [(h0 + i) // g - kh0 for i in range(qh.shape[1])]
        if idx != [i // (qh.shape[1] // kh.shape[1]) if qh.shape[1] % kh.shape[1] == 0 else -1
                   for i in range(qh.shape[1])]:
            sel = torch.tensor(idx, device=kh.device)
            kh, vh = kh.index_select(1, sel), vh.index_select(1, sel)  # GQA groups split unevenly here
        base, _ = _options(L, self.mask, causal, None, None)
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
        self._status(err, "forward")
        assert out is not None and lse is not None, "_status raised the failure"
        out = _SeqToHeads.apply(self, out, qr, H, 24)
        if return_lse:  # only then does lse travel back
            lse = _SeqToHeads.apply(self, lse.unsqueeze(-1), qr, H, 25).squeeze(-1)
        return out, lse

    def _h2s(self, x, ranges, tag, st):
        """(B, Hx, L_r, ·) this rank's rows of every head → (B, heads of ranges[rank], L, ·) every row."""
        r, P = self.rank, self.layout.positions
        a, b = ranges[r]
        peers = [p for p in range(self.W) if p != r]
        send = {p: x[:, ranges[p][0]:ranges[p][1]].contiguous() for p in peers}
        recv = {p: x.new_empty(x.shape[0], b - a, len(P[p]), x.shape[3]) for p in peers}
        self._p2p(send, recv, tag, "head all-to-all")
        st.bytes_sent += sum(t.numel() * t.element_size() for t in send.values())
        st.bytes_received += sum(t.numel() * t.element_size() for t in recv.values())
        parts = [x[:, a:b] if p == r else recv[p] for p in range(self.W)]
        return torch.cat(parts, 2).index_select(2, self.layout.inverse.to(x.device))

    def _s2h(self, y, ranges, Hx, tag, st):
        """The inverse of :meth:`_h2s`: (B, heads of ranges[rank], L, ·) → (B, Hx, L_r, ·), summing
        the contributions of ranks whose head ranges overlap (kv heads shared under MQA)."""
        r, P = self.rank, self.layout.positions
        yy = y.index_select(2, self.layout.order.to(y.device))
        pieces = list(torch.split(yy, self.layout.lengths, dim=2))
        peers = [p for p in range(self.W) if p != r]
        send = {p: pieces[p].contiguous() for p in peers}
        recv = {p: y.new_empty(y.shape[0], ranges[p][1] - ranges[p][0], len(P[r]), y.shape[3]) for p in peers}
        self._p2p(send, recv, tag, "head all-to-all (back)")
        st.bytes_sent += sum(t.numel() * t.element_size() for t in send.values())
        st.bytes_received += sum(t.numel() * t.element_size() for t in recv.values())
        out = y.new_zeros(y.shape[0], Hx, len(P[r]), y.shape[3])
        for p in range(self.W):
            a, b = ranges[p]
            out[:, a:b] += pieces[r] if p == r else recv[p]
        return out

    def _status(self, err, what):
        """After local compute: every rank learns whether any rank failed."""
        msg = "" if err is None else f"{type(err).__name__}: {err}"
        self._agree({"status": int(err is not None), "call": self._calls}, msg, what)
        if err is not None:
            raise err


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
        """Post round d: ``send`` to ``send_to`` and a receive like ``recv_like(peer)`` from
        ``recv_from`` (each skipped when None). Returns ``(peer, buffer, works)``."""
        cp, works, buf = self.cp, [], None
        if recv_from is not None:
            buf = recv_like(recv_from)
            works.append((recv_from, cp._issue(lambda: cp.dist.irecv(buf, src=cp._g(recv_from), group=cp.group,
                                                                     tag=tag + d), what, recv_from), "recv"))
        if send_to is not None and send is not None:
            works.append((send_to, cp._issue(lambda: cp.dist.isend(send, dst=cp._g(send_to), group=cp.group,
                                                                   tag=tag + d), what, send_to), "send"))
        return recv_from, buf, works

    def wait(self, works, what):
        for peer, w, kind in works:
            self.cp._wait(w, peer, f"{what} ({kind})")

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


class _CPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp, sched, opts, q, k, v, *captured):
        ctx.set_materialize_grads(False)  # an unused lse has no gradient (None), not zeros
        r, P = cp.rank, cp.layout.positions
        cp._sched = sched
        st = cp.stats = Stats()
        st.tiles_computed = int(sched.tiles[r].sum())
        st.tiles_skipped = int(sched.empty[r].sum())
        st.pairs_computed = int(sched.visible[r].sum())
        st.pairs_skipped = cp.W - st.pairs_computed
        keep = _keeps(cp, sched, r) if cp.comm == "p2p" else cp.keep_kv is not False
        kept: dict | None = None
        if cp.comm == "p2p":
            out, lse2, kept, err = _p2p_forward(cp, sched, opts, q.detach(), k.detach(), v.detach(), st, keep)
        else:
            err = out = lse2 = None
            local = {}

            def compute_local():  # the local pair runs while the K/V messages travel
                nonlocal err
                if sched.visible[r, r] and err is None:
                    try:
                        local[r] = _pair(q.detach(), k.detach(), v.detach(), P[r], P[r], sched.blocks(r, r), opts)
                    except Exception as e:
                        err = e

            kept = cp._exchange_kv(k, v, "forward K/V exchange", st, compute_local)
            st.kv_held_max = sum(1 for s in kept if s != r)
            if err is None:
                try:
                    out, c, rr = _rank_forward(q.detach(), kept, r, P[r], P, sched.row_blocks(r), opts, local,
                                               v.shape[-1])
                    lse2 = (c, rr)
                    st.steps = len(kept)
                except Exception as e:
                    err = e
        cp._status(err, "forward")
        assert out is not None and lse2 is not None, "_status raised the failure"
        ctx.cp, ctx.sched, ctx.opts, ctx.captured = cp, sched, opts, captured
        ctx.kv = kept if keep else None
        ctx.save_for_backward(q, k, v)
        ctx.out, ctx.lse2 = out, lse2
        ctx.call = cp._calls
        return out.to(q.dtype), lse2[0] + lse2[1]

    @staticmethod
    def backward(ctx, dout, dlse):
        cp, sched, opts = ctx.cp, ctx.sched, ctx.opts
        q, k, v = ctx.saved_tensors
        r, P = cp.rank, cp.layout.positions
        cp._sched = sched
        st = cp.backward_stats = Stats()
        acc = _acc_dtype(q.dtype)
        if cp.comm == "p2p":
            dq, dk, dv, cap = _p2p_backward(cp, sched, opts, q.detach(), k.detach(), v.detach(), ctx, dout, dlse,
                                            st)
            return (None, None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *cap)
        kv = ctx.kv if ctx.kv is not None else cp._exchange_kv(k, v, "backward K/V exchange", st)
        err, dq, parts, cap = None, None, {}, []
        try:
            dq, parts, cap = _rank_backward(q.detach(), kv, r, P[r], P, sched.row_blocks(r), opts, ctx.out, ctx.lse2,
                                            dout, dlse, list(ctx.captured))
            st.steps = len(kv)
        except Exception as e:
            err = e
        cp._status(err, "backward")
        D = k.shape[-1]
        full = torch.zeros(k.shape[0], k.shape[1], cp.seq_len, D + v.shape[-1], dtype=acc)
        for s, (pk, pv) in parts.items():
            full[:, :, P[s]] += torch.cat([pk, pv], -1)
        cp._check_alive()
        what = "backward dK/dV all_reduce"
        cp._wait(cp._issue(lambda: cp.dist.all_reduce(full, group=cp.group, async_op=True), what), None, what)
        nbytes = full.numel() * full.element_size()
        st.bytes_sent += 2 * (cp.W - 1) * nbytes // cp.W  # ring all-reduce traffic per rank
        st.bytes_received += 2 * (cp.W - 1) * nbytes // cp.W
        own = full[:, :, P[r]]
        dk, dv = own[..., :D], own[..., D:]
        assert dq is not None, "_status raised the failure"
        grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
        return (None, None, None, *grads, *cap)


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

    def recv_like(s):
        return k.new_empty(*shape, len(P[s]), D + v.shape[-1])

    def post(d):
        return stream.post(d, packed, recv_like, _Stream.KV_TAG, "forward K/V stream", stream.dst(d), stream.src(d))

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
        pending = post(stream.rounds[i + 1]) if i + 1 < len(stream.rounds) else None
        if pending is not None and pending[1] is not None:
            stream.hold(1)
        t = stream.dst(d)
        if t is not None and packed is not None:
            sent.append(t)
            st.bytes_sent += packed.numel() * elt
        if buf is None:
            continue
        received.append(s)
        st.bytes_received += buf.numel() * elt
        if err is None:
            try:
                part = tuple(x.to(acc) for x in _pair(q, buf[..., :D], buf[..., D:], P[r], P[s], sched.blocks(r, s),
                                                      opts))
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

    def kv_post(d):
        src = stream.src(d) if kept is None else None
        return stream.post(d, packed, lambda s: k.new_empty(*shape, len(P[s]), D + Dv), _Stream.KV_TAG,
                           "backward K/V stream", stream.dst(d) if refetch[d] else None, src)

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
        if refetch[d] and packed is not None:
            st.bytes_sent += packed.numel() * elt
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
            if err is None and rows is not None:
                try:
                    grad = torch.cat(rows.pair(s, ks, vs, sched.blocks(r, s)), -1).contiguous()
                except Exception as e:
                    err = e
            if grad is None:  # failed here: still answer the owner (the status exchange reports the failure)
                grad = torch.zeros(*shape, len(P[s]), D + Dv, dtype=acc, device=k.device)
        if buf is not None:
            stream.hold(-1)
        t = stream.dst(d)
        _, gbuf, gworks = stream.post(d, grad, lambda t: torch.empty(*shape, k.shape[2], D + Dv, dtype=acc,
                                                                     device=k.device),
                                      _Stream.GRAD_TAG, "backward dK/dV return", s, t)
        stream.wait(gworks, "backward dK/dV return")
        if grad is not None:
            st.bytes_sent += grad.numel() * grad.element_size()
        if gbuf is not None:
            st.bytes_received += gbuf.numel() * gbuf.element_size()
            dk += gbuf[..., :D]
            dv += gbuf[..., D:]
    st.steps = steps
    st.kv_held_max = stream.held_max
    cp._status(err, "backward")
    assert rows is not None
    return rows.dq, dk, dv, rows.cap


# ------------------------------------------------------------------------------------------ modules

def rope_at(rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x (..., L_r, D)`` whose rows sit at the global ``positions (L_r,)`` (any order, gaps
    allowed: a zigzag or balanced shard): ``rotary.rotate(x, positions=positions)``."""
    return rotary.rotate(x, positions=positions)


def block_forward(block, x: torch.Tensor, cp: ContextParallel, *, causal: bool | None = None) -> torch.Tensor:
    """An :class:`attnkit.nn.TransformerBlock` on this rank's rows ``x (B, L_r, E)``:
    ``block(x, causal=causal, context_parallel=cp)``."""
    return block(x, causal=causal, context_parallel=cp)


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp, x, ranges, tag):
        ctx.cp, ctx.ranges, ctx.tag, ctx.Hx = cp, ranges, tag, x.shape[1]
        return cp._h2s(x.detach(), ranges, tag, cp.stats)

    @staticmethod
    def backward(ctx, g):
        return None, ctx.cp._s2h(g.contiguous(), ctx.ranges, ctx.Hx, ctx.tag + 10, ctx.cp.backward_stats), None, None


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp, y, ranges, Hx, tag):
        ctx.cp, ctx.ranges, ctx.tag = cp, ranges, tag
        return cp._s2h(y.detach(), ranges, Hx, tag, cp.stats)

    @staticmethod
    def backward(ctx, g):
        return None, ctx.cp._h2s(g.contiguous(), ctx.ranges, ctx.tag + 10, ctx.cp.backward_stats), None, None, None
