"""bf16 against fp32 through ``auto`` with gradients, at the sizes where torch SDPA takes the fp32 call.

    OMP_NUM_THREADS=2 python benchmarks/bf16_grad.py [--rounds 20]

B = 1, H = 8, D = 64: no mask at L = S = 64, 256, 1024 (below the no-mask crossover SDPA runs fp32), and a
decode-sized call with a mask (L = 16 over S = 1024 keys, causal, and no mask). Each call is a forward and a
backward of ``out.sum()``; fp32 and bf16 timed in turns (one call of each per round, after one warm-up each).
Prints the fp32 time (fastest round), bf16 / fp32 as the median of the rounds' own ratios (< 1: bf16 faster)
and the worker ``auto`` chose for each dtype (``attnkit.dispatch``).
"""

from __future__ import annotations

import argparse

import torch
from _interleave import cpu_name, paired_ratio, rounds_ms

import attnkit

CASES = ((64, 64, {}), (256, 256, {}), (1024, 1024, {}), (16, 1024, {"causal": True}), (16, 1024, {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    print(f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    for L, S, kw in CASES:
        fns, workers = {}, {}
        for dt in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(1, 8, n, 64).to(dt).requires_grad_() for n in (L, S, S))
            workers[dt] = attnkit.dispatch(q, k, v, **kw).worker

            def call(q=q, k=k, v=v):
                attnkit.attention(q, k, v, **kw).sum().backward()

            fns[dt] = call
        runs = rounds_ms(fns, a.rounds if L * S <= 256 * 256 else max(3, a.rounds // 4))
        r = paired_ratio(runs[torch.bfloat16], runs[torch.float32])
        what = "causal" if kw else "no mask"
        print(f"L = {L}, S = {S}, {what}: forward + backward fp32 {min(runs[torch.float32]):.2f} ms, bf16 / fp32 "
              f"{r:.2f}; workers {workers[torch.float32]} / {workers[torch.bfloat16]}")


if __name__ == "__main__":
    main()
