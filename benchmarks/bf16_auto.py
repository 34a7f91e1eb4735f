"""bf16 against fp32 through ``auto``: the time of the same call in each dtype, forward and forward + backward.

    OMP_NUM_THREADS=2 python benchmarks/bf16_auto.py [--length 4096] [--rounds 10] [--user] [--accumulate]

B = 1, H = 8, D = 64; causal and sliding window 256; the fastest of ``--rounds`` runs of each (after one
warm-up), the two dtypes interleaved (one call of each in turn, so the machine's load hits both alike). Prints
bf16 time / fp32 time (< 1: bf16 is faster) as the ratio of the two fastest runs and, in brackets, as the median of
the rounds' own ratios (the two dtypes of a round ran side by side: on a shared machine the steadier of the two),
and the worker ``auto`` chose for each dtype (``attnkit.dispatch``).

Forward + backward: the output and the gradients of q, k and v (``torch.autograd.grad``), as a training step with
``zero_grad()`` (gradients set to None) gets them. ``--accumulate``: ``.backward()`` into the inputs' ``.grad``
instead, which after the first round adds each new gradient to the last (three torch adds a call, outside
attention: on a CPU without a native bf16 add, slower in bf16 than in fp32) — how the thirty-second session and
earlier measured this row.
"""

from __future__ import annotations

import argparse

import torch
from _interleave import cpu_name, paired_ratio, rounds_ms

import attnkit
from attnkit import masks as M


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--user", action="store_true", help="also the window written as a user's mask_mod and causal with "
                    "a user's soft-cap score_mod (lambdas: traced on the kernel)")
    ap.add_argument("--accumulate", action="store_true", help="the backward into the inputs' .grad, each round's "
                    "gradient added to the last (the earlier sessions' measure)")
    a = ap.parse_args()
    torch.manual_seed(0)
    L = a.length
    print(f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    cases = [("causal", dict(causal=True)), ("window 256", dict(mask=M.sliding_window(256)))]
    if a.user:
        cases += [("window 256 as a mask_mod", dict(mask=lambda b, h, q, kv: (kv <= q) & (q - kv < 256))),
                  ("causal + a soft-cap score_mod", dict(causal=True,
                                                         score_mod=lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0)))]
    for name, kw in cases:
        fns, workers = {}, {}
        for dt in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(1, 8, L, 64).to(dt).requires_grad_() for _ in range(3))
            go = torch.randn(1, 8, L, 64).to(dt)
            workers[dt] = attnkit.dispatch(q, k, v, **kw).worker

            def fwd(q=q, k=k, v=v):
                with torch.no_grad():
                    attnkit.attention(q, k, v, **kw)

            def fwd_bwd(q=q, k=k, v=v, go=go):
                out = attnkit.attention(q, k, v, **kw)
                if a.accumulate:
                    out.backward(go)
                else:
                    torch.autograd.grad(out, (q, k, v), go)

            fns[("fwd", dt)], fns[("fwd_bwd", dt)] = fwd, fwd_bwd
        runs = rounds_ms(fns, a.rounds)
        t = {n: min(x) for n, x in runs.items()}
        f32, b16 = torch.float32, torch.bfloat16
        pf = paired_ratio(runs["fwd", b16], runs["fwd", f32])
        pb = paired_ratio(runs["fwd_bwd", b16], runs["fwd_bwd", f32])
        print(f"{name}, L = {L}: forward fp32 {t['fwd', f32]:.1f} ms, bf16 {t['fwd', b16]:.1f} ms (bf16 / fp32 "
              f"{t['fwd', b16] / t['fwd', f32]:.2f} [{pf:.2f}]); forward + backward fp32 {t['fwd_bwd', f32]:.1f} ms, "
              f"bf16 {t['fwd_bwd', b16]:.1f} ms ({t['fwd_bwd', b16] / t['fwd_bwd', f32]:.2f} [{pb:.2f}]); workers "
              f"{workers[f32]} / {workers[b16]}")


if __name__ == "__main__":
    main()
