"""bf16 against fp32 through ``auto`` at the small shapes models run every step (decode, short prompts).

    OMP_NUM_THREADS=2 python benchmarks/bf16_small.py [--rounds 200] [--only SUBSTRING] [--accumulate] [--bf16-first]

Each row calls ``attnkit.attention`` on the same shape in fp32 and in bf16, timed in turns (one call of each per
round, after one warm-up each), without gradients and then with a backward of ``out.sum()`` (rows marked "+ bwd"):
each backward into gradients set to None first, as a training step's ``optimizer.zero_grad()`` leaves them (with
``--accumulate`` they are kept, and autograd adds each call's into them: torch's ``add_``, in the gradients' dtype,
outside attention; at a decode step's size its bf16 ``add_`` costs more than its fp32 one).
Prints the fp32 time (median), bf16 / fp32 as the median of the rounds' own ratios (< 1: bf16 faster), and the
worker ``auto`` chose for each dtype (``attnkit.dispatch``). Shapes as in ``benchmarks/everyday.py``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _interleave import cpu_name, paired_ratio, rounds_ms

import attnkit

CASES = (  # name, B, H, Hkv, L, S, D, keyword arguments
    ("decode L=1, S=128, GQA 8/2, D=64", 1, 8, 2, 1, 128, 64, {"causal": True}),
    # the same step with causal as a user's mask_mod, and with a soft cap as a user's score_mod
    ("decode L=1, S=128, GQA 8/2, D=64, causal as a mask_mod", 1, 8, 2, 1, 128, 64,
     {"mask": lambda b, h, q, kv: kv <= q + 127}),
    ("decode L=1, S=128, GQA 8/2, D=64, causal + a soft-cap score_mod", 1, 8, 2, 1, 128, 64,
     {"causal": True, "score_mod": lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0)}),
    ("decode L=1, S=2048, GQA 8/2, D=64", 1, 8, 2, 1, 2048, 64, {"causal": True}),
    # the same step with causal written as a user's mask_mod (the query is the last position), and with a soft cap
    # written as a user's score_mod (a traced program on the kernel)
    ("decode L=1, S=2048, GQA 8/2, D=64, causal as a mask_mod", 1, 8, 2, 1, 2048, 64,
     {"mask": lambda b, h, q, kv: kv <= q + 2047}),
    ("decode L=1, S=2048, GQA 8/2, D=64, causal + a soft-cap score_mod", 1, 8, 2, 1, 2048, 64,
     {"causal": True, "score_mod": lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0)}),
    ("prefill L=S=64, B=2, H=4, D=16, causal", 2, 4, 4, 64, 64, 16, {"causal": True}),
    ("prefill L=S=200, GQA 4/2, D=64, causal", 1, 4, 2, 200, 200, 64, {"causal": True}),
    ("own bool mask L=S=64, H=8, D=64", 1, 8, 8, 64, 64, 64, {"mask": "bool"}),
    ("no mask L=S=64, H=8, D=64", 1, 8, 8, 64, 64, 64, {}),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--only", default="")
    ap.add_argument("--accumulate", action="store_true", help="keep the gradients between calls (autograd adds)")
    ap.add_argument("--bf16-first", action="store_true",
                    help="time the bf16 call first in each round (default: fp32 first): an order effect shows as a "
                         "different ratio")
    a = ap.parse_args()
    print(f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads; gradients "
          f"{'accumulated' if a.accumulate else 'set to None before each backward'}")
    print("| call | fp32 | bf16 / fp32 | workers fp32 / bf16 |\n|---|---|---|---|")
    torch.manual_seed(0)
    for name, B, H, Hkv, L, S, D, kw in CASES:
        if a.only not in name:
            continue
        for grad in (False, True):
            fns, workers = {}, {}
            for dt in (torch.bfloat16, torch.float32) if a.bf16_first else (torch.float32, torch.bfloat16):
                q = torch.randn(B, H, L, D).to(dt).requires_grad_(grad)
                k, v = (torch.randn(B, Hkv, S, D).to(dt).requires_grad_(grad) for _ in range(2))
                kws = dict(kw)
                if kws.get("mask") == "bool":
                    kws["mask"] = torch.rand(L, S, generator=torch.Generator().manual_seed(1)) < 0.7
                    kws["mask"][:, 0] = True
                workers[dt] = attnkit.dispatch(q, k, v, **kws).worker

                if grad and a.accumulate:
                    def call(q=q, k=k, v=v, kws=kws):
                        attnkit.attention(q, k, v, **kws).sum().backward()
                elif grad:
                    def call(q=q, k=k, v=v, kws=kws):
                        q.grad = k.grad = v.grad = None
                        attnkit.attention(q, k, v, **kws).sum().backward()
                else:
                    def call(q=q, k=k, v=v, kws=kws):
                        attnkit.attention(q, k, v, **kws)
                fns[dt] = call
            n = a.rounds if not grad else max(20, a.rounds // 4)
            runs = rounds_ms(fns, n)
            r = paired_ratio(runs[torch.bfloat16], runs[torch.float32])
            t = statistics.median(runs[torch.float32]) * 1e3
            print(f"| {name}{' + bwd' if grad else ''} | {t:.1f} µs | {r:.2f} | "
                  f"{workers[torch.float32]} / {workers[torch.bfloat16]} |", flush=True)


if __name__ == "__main__":
    main()
