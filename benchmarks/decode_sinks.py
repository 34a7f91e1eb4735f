"""A decode step whose mask keeps a few attention sinks and a window (StreamingLLM): two stretches of keys per row.

    OMP_NUM_THREADS=2 python benchmarks/decode_sinks.py [--lengths 2048 4096 8192 32768] [--repeats 50]

One query row (B = 1, H = 8 query heads over Hkv = 2 kv heads, D = 64) over S cached keys; the mask keeps the
first 4 keys and the last 1024. Callables, timed in turns (one batch of ``--repeats`` calls of each per round, the
fastest round's mean), per S:

* SDPA with that mask as a bool tensor (``attn_mask``, ``enable_gqa=True``);
* attnkit, the mask as a user's ``mask_mod`` (``(kv < 4) | (kv > q + S - 1 - 1024)``) and as the same bool
  tensor;
* attnkit, that ``mask_mod`` with a soft cap written as a lambda (``score_mod``: a traced program on each call);
* ``attnkit.flex_attention`` with ``attnkit.create_block_mask`` of that mod, built once per S (FlexAttention's way);
* attnkit, the window alone as a ``mask_mod`` (one stretch: what the step costs without the sinks).

``ratio`` = SDPA's time / attnkit's (> 1: attnkit faster); ``worker`` = what ``attnkit.dispatch`` chose for the
mod. Only the ratios of one run count (the machine's load moves every time).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _interleave import cpu_name

import attnkit


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    B, H, Hkv, D, SINKS, W = 1, 8, 2, 64, 4, 1024
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"B = {B}, H = {H}, Hkv = {Hkv}, D = {D}, L = 1; the first {SINKS} keys and the last {W} kept\n")
    print("| S | SDPA, bool mask (µs) | attnkit, `mask_mod` (µs) | ratio | attnkit, bool mask (µs) | ratio | "
          "+ a soft cap (µs) | `flex_attention` (µs) | ratio | attnkit, the window alone (µs) | worker |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for S in a.lengths:
        g = torch.Generator().manual_seed(S)
        k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
        q = torch.randn(B, H, 1, D, generator=g)
        keys = torch.arange(S)
        kept = ((keys < SINKS) | (keys > S - 1 - W)).view(1, 1, 1, S)

        def sinks(b, h, qi, kv, S=S):
            return (kv < SINKS) | (kv > qi + S - 1 - W)

        def window(b, h, qi, kv, S=S):
            return kv > qi + S - 1 - W

        def cap(score, b, h, qi, kv):
            return 30.0 * torch.tanh(score / 30.0)

        bm = attnkit.create_block_mask(sinks, 1, None, 1, S)

        fns = {
            "sdpa": lambda q=q, k=k, v=v, m=kept: F.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                                                 enable_gqa=True),
            "mod": lambda q=q, k=k, v=v, m=sinks: attnkit.attention(q, k, v, mask=m),
            "bool": lambda q=q, k=k, v=v, m=kept: attnkit.attention(q, k, v, mask=m),
            "cap": lambda q=q, k=k, v=v, m=sinks: attnkit.attention(q, k, v, mask=m, score_mod=cap),
            "flex": lambda q=q, k=k, v=v, m=bm: attnkit.flex_attention(q, k, v, block_mask=m, enable_gqa=True),
            "window": lambda q=q, k=k, v=v, m=window: attnkit.attention(q, k, v, mask=m),
        }
        for f in fns.values():
            f()
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(a.rounds):
            for name, f in fns.items():
                t0 = time.perf_counter()
                for _ in range(a.repeats):
                    f()
                best[name] = min(best[name], (time.perf_counter() - t0) / a.repeats)
        us = {n: t * 1e6 for n, t in best.items()}
        worker = attnkit.dispatch(q, k, v, mask=sinks).kernel.name
        print(f"| {S} | {us['sdpa']:.1f} | {us['mod']:.1f} | {us['sdpa'] / us['mod']:.2f} | {us['bool']:.1f} | "
              f"{us['sdpa'] / us['bool']:.2f} | {us['cap']:.1f} | {us['flex']:.1f} | {us['sdpa'] / us['flex']:.2f} | "
              f"{us['window']:.1f} | {worker} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
