"""FlexAttention code switched by one import, against the same mask built in.

    OMP_NUM_THREADS=2 python benchmarks/flex_switch.py [--length 4096] [--rounds 5]

A user's FlexAttention code, unchanged but for ``from attnkit import create_block_mask, flex_attention``:
``block_mask = create_block_mask(mod, B, None, L, L)`` once, then ``flex_attention(q, k, v,
block_mask=block_mask)`` — against ``attnkit.attention`` with attnkit's built-in mask of the same meaning.
Mods: a sliding window of 256 (reads only the indices), packed documents (reads a tensor of ids) and a prefix-LM
of 512 (``|`` of two conditions). B = 1, H = 8, D = 64, fp32, forward and forward + backward; the two calls
interleaved (one of each in turn), the fastest of ``--rounds`` each, after one warm-up. Prints each side's ms,
the ratio (built-in time / flex time: 1.00 = as fast as the built-in mask) and the kernel ``dispatch`` chose
for each. FLOPs are the same on both sides (the same visible pairs), so only the ratio is printed.
"""

from __future__ import annotations

import argparse

import torch
from _interleave import best_ms

import attnkit
from attnkit import create_block_mask, flex_attention
from attnkit import masks as M


def _cases(L: int):
    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 256)

    ids = torch.arange(L) * 7 // L  # 7 packed documents

    def document(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < 512) | (kv_idx <= q_idx)

    return (("window 256", window, M.sliding_window(256)),
            ("documents x7", document, M.document(ids) & M.causal()),
            ("prefix-LM 512", prefix_lm, M.prefix_lm(512)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    L = a.length
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, L, 64, requires_grad=True) for _ in range(3))
    go = torch.randn(1, 8, L, 64)
    print(f"L = {L}, B = 1, H = 8, D = 64, fp32, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| mask | mode | built-in ms | flex_attention ms | built-in / flex | kernel (built-in / flex) |")
    print("|---|---|---|---|---|---|")
    for name, mod, builtin in _cases(L):
        bm = create_block_mask(mod, 1, None, L, L)
        kernels = (attnkit.dispatch(q, k, v, mask=builtin).worker, attnkit.dispatch(q, k, v, mask=bm).worker)
        with torch.no_grad():
            fwd = best_ms({"builtin": lambda b=builtin: attnkit.attention(q, k, v, mask=b),
                            "flex": lambda bm=bm: flex_attention(q, k, v, block_mask=bm)}, a.rounds)
        both = best_ms({"builtin": lambda b=builtin: attnkit.attention(q, k, v, mask=b).backward(go),
                         "flex": lambda bm=bm: flex_attention(q, k, v, block_mask=bm).backward(go)}, a.rounds)
        for mode, t in (("fwd", fwd), ("fwd + bwd", both)):
            print(f"| {name} | {mode} | {t['builtin']:.1f} | {t['flex']:.1f} | {t['builtin'] / t['flex']:.2f} | "
                  f"{kernels[0]} / {kernels[1]} |")


if __name__ == "__main__":
    main()
