"""Layouts: which units of ``block`` positions each rank owns (contiguous, zigzag, balanced)."""

from __future__ import annotations

import heapq
import zlib

import torch

from .. import plans as _plans
from .._tiling import EMPTY

_LAYOUTS = ("contiguous", "zigzag", "balanced")


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
    """The most K/V rows one rank sends under the plan-aware schedule of this assignment: to each rank
    that sees it, the run of its units from the first to the last one that rank reads (what
    ``Schedule.span`` sends, at unit resolution)."""
    W = len(units)
    idx = [torch.tensor(sorted(us), dtype=torch.long) for us in units]
    most = 0.0
    for s in range(W):
        if not len(idx[s]):
            continue
        cols = live[:, idx[s]]  # (n, units of s): which query units see each of s's units
        sent = 0
        for t in range(W):
            if t == s or not len(idx[t]):
                continue
            need = torch.nonzero(cols[idx[t]].any(0)).flatten()
            if need.numel():
                sent += int(need[-1]) - int(need[0]) + 1
        most = max(most, float(sent * block))
    return most


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
