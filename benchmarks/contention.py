"""How much a busy machine costs attnkit, against how much it costs SDPA (issue 20: "robust under contention").

    OMP_NUM_THREADS=2 python benchmarks/contention.py            # ~1 min on 2 cores

The job: sliding window 256, L = 2048, B = 1, H = 8, D = 64, fp32, forward + backward, 2 threads.
Peers: attnkit (``auto``: the compiled kernel) and SDPA given the same mask as a dense bool tensor.
Each is timed alone, then with one busy-loop process beside it (a Python ``while True`` on the same
cores), interleaved round by round; reported: the medians and each peer's slowdown (busy / quiet).
Goal: attnkit's slowdown ≤ SDPA's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks as M


def _spin(stop):
    x = 0
    while not stop.is_set():
        x += 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--length", type=int, default=2048)
    a = ap.parse_args()
    L = a.length
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, L, 64, generator=g).requires_grad_() for _ in range(3))
    go = torch.randn(1, 8, L, 64, generator=g)
    mask = M.sliding_window(256)
    dense = mask.materialize(1, 1, L, L)
    peers = {
        "attnkit": lambda: attnkit.attention(q, k, v, mask=mask).backward(go),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense).backward(go),
    }
    print(f"attnkit runs: {attnkit.dispatch(q, k, v, mask=mask)}")
    for f in peers.values():
        f()
    times = {(p, busy): [] for p in peers for busy in (False, True)}
    ctx = mp.get_context("spawn")
    for _ in range(a.rounds):
        for busy in (False, True):
            stop = ctx.Event()
            proc = ctx.Process(target=_spin, args=(stop,)) if busy else None
            if proc:
                proc.start()
                time.sleep(0.3)  # let it run
            for p, f in peers.items():
                t0 = time.perf_counter()
                f()
                times[(p, busy)].append(time.perf_counter() - t0)
            if proc:
                stop.set()
                proc.join()
    print(f"window 256, L = {L}, forward + backward, {torch.get_num_threads()} threads, median of {a.rounds}")
    print(f"{'peer':<9}{'quiet ms':>10}{'busy ms':>10}{'slowdown':>10}")
    slow = {}
    for p in peers:
        quiet, busy = statistics.median(times[(p, False)]), statistics.median(times[(p, True)])
        slow[p] = busy / quiet
        print(f"{p:<9}{quiet * 1e3:>10.1f}{busy * 1e3:>10.1f}{slow[p]:>9.2f}x")
    print(f"attnkit's slowdown / SDPA's: {slow['attnkit'] / slow['sdpa']:.2f} (goal <= 1)")


if __name__ == "__main__":
    main()
