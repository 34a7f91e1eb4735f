"""bf16 against fp32 through ``auto``: the time of the same call in each dtype, forward and forward + backward.

    OMP_NUM_THREADS=2 python benchmarks/bf16_auto.py [--length 4096] [--rounds 3]

B = 1, H = 8, D = 64; causal and sliding window 256; the fastest of ``--rounds`` runs of each (after one
warm-up), both dtypes measured in the same run. Prints bf16 time / fp32 time (< 1: bf16 is faster) and the
worker ``auto`` chose for each dtype (``attnkit.dispatch``).
"""

from __future__ import annotations

import argparse
import time

import torch

import attnkit
from attnkit import masks as M


def _best_ms(f, rounds: int) -> float:
    f()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    L = a.length
    for name, kw in (("causal", dict(causal=True)), ("window 256", dict(mask=M.sliding_window(256)))):
        res = {}
        for dt in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(1, 8, L, 64).to(dt).requires_grad_() for _ in range(3))
            go = torch.randn(1, 8, L, 64).to(dt)
            worker = attnkit.dispatch(q, k, v, **kw).worker

            def fwd(q=q, k=k, v=v):
                with torch.no_grad():
                    attnkit.attention(q, k, v, **kw)

            def fwd_bwd(q=q, k=k, v=v, go=go):
                attnkit.attention(q, k, v, **kw).backward(go)

            res[dt] = (_best_ms(fwd, a.rounds), _best_ms(fwd_bwd, a.rounds), worker)
        f, b = res[torch.float32], res[torch.bfloat16]
        print(f"{name}, L = {L}: forward fp32 {f[0]:.1f} ms, bf16 {b[0]:.1f} ms (bf16 / fp32 {b[0] / f[0]:.2f}); "
              f"forward + backward fp32 {f[1]:.1f} ms, bf16 {b[1]:.1f} ms ({b[1] / f[1]:.2f}); "
              f"workers {f[2]} / {b[2]}")


if __name__ == "__main__":
    main()
