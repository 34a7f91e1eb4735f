"""Context parallelism on paper: bytes each rank sends and how even the work is, per layout.

Counting only (no attention is computed, no process is started): the layouts and the
plan-aware schedule of :mod:`attnkit.distributed`, for causal, sliding-window and document
masks, against a plain ring (every rank's K/V visits every other rank, W - 1 steps).

    PYTHONPATH=src python benchmarks/context_parallel.py            # W = 4, 8 at L = 128K, then scaling
    PYTHONPATH=src python benchmarks/context_parallel.py --quick    # smaller, for a smoke test

Columns:
    sent/rank   forward K/V bytes a rank sends: max over ranks (mean in brackets), MiB, for
                B = 1, Hkv = 8, D = Dv = 128, bf16 (4 KiB per position); heads (Ulysses) also
                moves q and the output (H = 32: 8 KiB each per position)
    peers       max number of ranks one rank sends to
    work        busiest rank's attended (query, key) pairs over the mean (1.00 = perfect);
                exact per-row counts of the mask, not tiles
    computed    fraction of (query rank, key rank) pairs computed
"""

from __future__ import annotations

import argparse
import time

import torch

import attnkit.distributed as akd
from attnkit import masks as M

BYTES_PER_POS = 1 * 8 * (128 + 128) * 2
# heads (Ulysses) moves q (H = 32 heads) and k, v out, and the output back: per position and rank
Q_BYTES_PER_POS = OUT_BYTES_PER_POS = 1 * 32 * 128 * 2


def doc_ids(L: int, seed: int = 0) -> torch.Tensor:
    """Packed documents, lengths log-uniform between 256 and L/4 (a few long ones dominate)."""
    g = torch.Generator().manual_seed(seed)
    out, d, n = [], 0, 0
    while n < L:
        ln = int(torch.exp(torch.empty(1).uniform_(5.5, max(5.6, float(torch.log(torch.tensor(L / 4.0)))),
                                                    generator=g)))
        out.append(torch.full((min(ln, L - n),), d))
        n += ln
        d += 1
    return torch.cat(out)[:L]


def row_work(name: str, L: int, ids=None) -> torch.Tensor:
    """Exact number of keys each query row attends (closed forms, O(L))."""
    i = torch.arange(L, dtype=torch.float64)
    if name == "causal":
        return i + 1
    if name.startswith("window"):
        return torch.clamp(i + 1, max=float(name.split()[1]))
    if name == "document":
        _, inv, counts = torch.unique_consecutive(ids, return_inverse=True, return_counts=True)
        return counts.double()[inv]
    raise ValueError(name)


def masks_for(L: int):
    ids = doc_ids(L)
    return [("causal", M.causal(), None), ("window 4096", M.sliding_window(4096), None),
            ("document", M.document(ids), ids)]


def measure(L: int, W: int, mname: str, mask, ids):
    work = row_work(mname, L, ids)
    rows = []
    for scheme, lname, plan_aware in (("ring, contiguous", "contiguous", False),
                                      ("ring, zigzag", "zigzag", False),
                                      ("plan-aware, contiguous", "contiguous", True),
                                      ("plan-aware, zigzag", "zigzag", True),
                                      ("plan-aware, balanced", "balanced", True)):
        lay = akd.layout(lname, L, W, mask=mask)
        per = torch.stack([work[p].sum() for p in lay.positions])
        balance = float(per.max() / per.mean())
        tokens = max(lay.lengths) / (L / W)
        if plan_aware:
            sched = akd.schedule(lay, mask)
            # only the rows of a shard that the receiver's blocks read travel (Schedule.span)
            sent = [sum(sched.span(t, s)[1] - sched.span(t, s)[0] for t in sched.send_to[s]) for s in range(W)]
            peers = max(len(t) for t in sched.send_to)
            computed = float(sched.visible.double().mean())
            held = sched.held("auto")
        else:
            sent = [lay.lengths[s] * (W - 1) for s in range(W)]  # the shard visits every other rank
            peers = W - 1
            computed = 1.0
            held = 2  # a ring holds the shard it computes on and the next
        mib = [x * BYTES_PER_POS / 2**20 for x in sent]
        rows.append((scheme, max(mib), sum(mib) / W, peers, balance, computed, tokens, held))
    # heads: every rank sends (W-1)/W of its rows of q, k, v and of the output; work is even by heads
    lay = akd.layout("contiguous", L, W)
    per_pos = Q_BYTES_PER_POS + BYTES_PER_POS + OUT_BYTES_PER_POS
    mib = [n * (W - 1) / W * per_pos / 2**20 for n in lay.lengths]
    if 32 % W == 0:  # needs H % W == 0
        rows.append(("heads (Ulysses, H = 32)", max(mib), sum(mib) / W, W - 1, 1.0, 1.0, 1.0, 0))
    else:
        rows.append(("heads (Ulysses, H = 32)", float("nan"), float("nan"), W - 1, float("nan"), 1.0, 1.0, 0))
    return rows


def _f(x, fmt):
    return "n/a (H % W ≠ 0)" if x != x else format(x, fmt)


def table(L: int, W: int):
    print(f"\n### L = {L:,}, W = {W} (default block {akd.default_block(L, W)})\n")
    print("| mask | scheme | sent/rank MiB max (mean) | peers | work busiest/mean | tokens busiest/mean "
          "| K/V shards held | pairs computed |")
    print("|---|---|---|---|---|---|---|---|")
    for mname, mask, ids in masks_for(L):
        for scheme, mx, mean, peers, bal, comp, tok, held in measure(L, W, mname, mask, ids):
            sent = _f(mx, ",.0f") + ("" if mx != mx else f" ({mean:,.0f})")
            held_s = "— (whole sequence, H/W heads)" if scheme.startswith("heads") else str(held)
            print(f"| {mname} | {scheme} | {sent} | {peers} | {_f(bal, '.3f')} | {tok:.2f} | {held_s} | {comp:.0%} |")


def scaling(Ls, Ws):
    print("\n### Scaling (plan-aware balanced vs plain ring; counting only)\n")
    print("| L | W | mask | ring sent/rank MiB | balanced sent/rank MiB max | heads sent/rank MiB "
          "| ring work busiest/mean | balanced work busiest/mean | balanced tokens busiest/mean | K/V shards held "
          "| plan+layout s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for L in Ls:
        for mname, mask, ids in masks_for(L):
            for W in Ws:
                t = time.time()
                r = {s[0]: s for s in measure(L, W, mname, mask, ids)}
                ring, bal, heads = r["ring, contiguous"], r["plan-aware, balanced"], r["heads (Ulysses, H = 32)"]
                print(f"| {L:,} | {W} | {mname} | {ring[1]:,.0f} | {bal[1]:,.0f} | {_f(heads[1], ',.0f')} "
                      f"| {ring[4]:.3f} | {bal[4]:.3f} | {bal[6]:.2f} | {bal[7]} "
                      f"| {time.time() - t:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.quick:
        for W in (4, 8):
            table(16384, W)
        scaling([65536], [16])
        return
    for W in (4, 8):
        table(131072, W)
    scaling([131072, 1048576], [8, 16, 32, 64])


if __name__ == "__main__":
    main()
