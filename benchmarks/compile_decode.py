"""A decode step inside torch.compile: attnkit's op against compiled SDPA, and against attnkit called eagerly.

    OMP_NUM_THREADS=2 python benchmarks/compile_decode.py [--lengths 1024 4096] [--repeats 200] [--rounds 3]

One query row (B = 1, H = 8 query heads over Hkv = 2 kv heads, D = 64, fp32) over S cached keys, under
``torch.no_grad()``. Each callable is a one-call function, ``torch.compile``d (inductor, ``fullgraph=True``) and
warmed up before timing; rounds interleave the callables (one batch of ``--repeats`` calls of each in turn), and
each cell is the fastest round's mean:

* compiled SDPA: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` (no mask: one query row of a causal
  decoder sees the whole cache), and with a window of 1024 keys as a bool tensor (``attn_mask``);
* compiled attnkit: ``masks.causal()``, ``masks.sliding_window(1024)``, attention sinks + the window as a
  ``mask_mod`` (the first 4 keys and the last 1024), causal + a soft cap as a ``score_mod`` (a lambda);
* attnkit called eagerly with ``masks.causal()`` (what the op's own machinery costs on top: torch.compile's guards,
  the custom op's dispatch and autograd wrapper).

``ratio`` = compiled SDPA's plain step / the row (> 1: the row is faster). Run it with each source tree on
``PYTHONPATH`` for a before / after; only the ratios of one run count.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _interleave import cpu_name

import attnkit
from attnkit import masks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    B, H, Hkv, D, W = 1, 8, 2, 64, 1024
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"B = {B}, H = {H}, Hkv = {Hkv}, D = {D}, L = 1, fp32, no_grad; torch.compile(fullgraph=True), inductor\n")
    torch._dynamo.config.recompile_limit = 64  # (every row its own function; each S a new shape)
    g = torch.Generator().manual_seed(0)
    for S in a.lengths:
        q = torch.randn(B, H, 1, D, generator=g)
        k = torch.randn(B, Hkv, S, D, generator=g)
        v = torch.randn(B, Hkv, S, D, generator=g)
        window = torch.arange(S).view(1, 1, 1, S) > S - 1 - W

        def sinks(b, h, q_idx, kv_idx, S=S):
            return (kv_idx < 4) | (kv_idx > q_idx + S - 1 - W)

        def cap(s, b, h, q_idx, kv_idx):
            return 30.0 * torch.tanh(s / 30.0)

        def compiled(f):
            return torch.compile(f, fullgraph=True)

        rows = {
            "compiled SDPA (no mask)": compiled(
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
            "compiled SDPA, a window of 1024 as a bool tensor": compiled(
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=window, enable_gqa=True)),
            "compiled attnkit, `masks.causal()`": compiled(
                lambda q, k, v: attnkit.attention(q, k, v, mask=masks.causal())),
            "compiled attnkit, `masks.sliding_window(1024)`": compiled(
                lambda q, k, v: attnkit.attention(q, k, v, mask=masks.sliding_window(W))),
            "compiled attnkit, sinks + the window as a `mask_mod`": compiled(
                lambda q, k, v: attnkit.attention(q, k, v, mask=sinks)),
            "compiled attnkit, causal + a soft cap as a `score_mod`": compiled(
                lambda q, k, v: attnkit.attention(q, k, v, mask=masks.causal(), score_mod=cap)),
            "attnkit eager, `masks.causal()`": lambda q, k, v: attnkit.attention(q, k, v, mask=masks.causal()),
        }
        best = dict.fromkeys(rows, float("inf"))
        with torch.no_grad():
            for f in rows.values():
                for _ in range(5):
                    f(q, k, v)
            for _ in range(a.rounds):
                for name, f in rows.items():
                    t = time.perf_counter()
                    for _ in range(a.repeats):
                        f(q, k, v)
                    best[name] = min(best[name], (time.perf_counter() - t) / a.repeats)
        base = best["compiled SDPA (no mask)"]
        print(f"S = {S}\n\n| call | µs per step | ratio (compiled SDPA / this) |\n|---|---|---|")
        for name, t in best.items():
            print(f"| {name} | {t * 1e6:.1f} | {base / t:.2f} |")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
