"""A few query rows with gradients: attnkit's compiled kernel against torch SDPA, forward + backward.

    OMP_NUM_THREADS=2 python benchmarks/few_rows_grad.py [--rounds 100] [--dtype fp32|bf16]

Each row times ``attention(q, k, v, causal=True, backend=...)`` followed by ``out.sum().backward()``, the kernel
(``backend="tiled"``) and SDPA (``backend="sdpa"``) in turns, one call of each per round after a warm-up, and prints
both medians and kernel / SDPA as the median of the rounds' own ratios (< 1: the kernel is faster). Shapes: decode-
sized calls (one query row over a cache, GQA 8/2), a few rows (a speculative draft, a handful of latent queries), and
short prompts whose last query block holds fewer than 64 rows (L = 40, L = 200 = 3 * 64 + 8); a decode step with causal
written as a user's ``mask_mod``, and with Gemma 2's soft cap as the kernel's ``score_mod`` (SDPA runs no score_mod:
its column is the plain step).

FLOPs of one call, forward + backward: 4·B·H·L'·S'·D for the forward (QKᵀ and PV) and 10·B·H·L'·S'·D for the
backward (QKᵀ again, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q, dS·K), L'·S' the (query, key) pairs the causal mask keeps — every row here
is a few hundred kFLOP to a few MFLOP: these calls are bound by their fixed costs, not by the arithmetic.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _interleave import cpu_name, paired_ratio, rounds_ms

import attnkit
from attnkit import score_mods

CAP = score_mods.softcap(30.0)
CASES = (  # name, B, H, Hkv, L, S, D, the kernel's score_mod (SDPA runs none: its plain step) or "mod": causal as a
    # user's mask_mod (on both: SDPA's causal step)
    ("decode L=1 over S=128, GQA 8/2, D=64", 1, 8, 2, 1, 128, 64, None),
    ("decode L=1 over S=2048, GQA 8/2, D=64", 1, 8, 2, 1, 2048, 64, None),
    ("decode L=1 over S=2048, GQA 8/2, D=64, causal as a user's mask_mod", 1, 8, 2, 1, 2048, 64, "mod"),
    ("decode L=1 over S=2048, GQA 8/2, D=64, soft cap (SDPA: without)", 1, 8, 2, 1, 2048, 64, CAP),
    ("L=4 over S=1024, GQA 8/2, D=64", 1, 8, 2, 4, 1024, 64, None),
    ("L=16 over S=512, H=8, D=64", 1, 8, 8, 16, 512, 64, None),
    ("L=S=40, H=8, D=64", 2, 8, 8, 40, 40, 64, None),
    ("L=S=200, GQA 4/2, D=64", 1, 4, 2, 200, 200, 64, None),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    a = ap.parse_args()
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    print(f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads, {a.dtype}")
    print("| call | kernel | SDPA | kernel / SDPA |\n|---|---|---|---|")
    torch.manual_seed(0)
    for name, B, H, Hkv, L, S, D, mod in CASES:
        q = torch.randn(B, H, L, D).to(dt).requires_grad_()
        k, v = (torch.randn(B, Hkv, S, D).to(dt).requires_grad_() for _ in range(2))
        fns = {}
        for be in ("tiled", "sdpa"):
            kw = {"causal": True}
            if mod == "mod" and be == "tiled":  # (a lambda of its own each run: the kernel reads its content)
                kw = {"mask": lambda b, h, i, j, off=S - L: j <= i + off}
            elif mod is not None and mod != "mod" and be == "tiled":
                kw["score_mod"] = mod

            def call(be=be, kw=kw):
                attnkit.attention(q, k, v, backend=be, **kw).sum().backward()
            fns[be] = call
        runs = rounds_ms(fns, a.rounds)
        t = {be: statistics.median(r) * 1e3 for be, r in runs.items()}
        ratio = paired_ratio(runs["tiled"], runs["sdpa"])
        print(f"| {name} | {t['tiled']:.0f} µs | {t['sdpa']:.0f} µs | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
