"""How many repeated forward + backward runs give the same bits as the first, for every kernel path.

    OMP_NUM_THREADS=2 python benchmarks/reproducible.py --repeats 100 --threads 2,4

Each path runs ``--repeats`` times on the same inputs (FlashAttention's deterministic check: sliding window
100, B = 4, H = 9 / 3, L = 257, S = 239, D = 59, fp32, and the others below); out, lse, dq, dk, dv (and the
gradient into a learnable table) are compared bitwise with the first run. Prints one row per path and
thread count: equal runs / runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from _flashmask import families

import attnkit
from attnkit import masks as M
from attnkit import score_mods as SM


def paths():
    fam = families(300, H=6, seed=3)
    table = torch.randn(6, 601, requires_grad=True)
    return [
        ("window 100 (flash_attn_deterministic)", (4, 9, 3, 257, 239, 59), {"mask": M.sliding_window(100)}, ()),
        ("causal", (2, 6, 2, 300, 300, 64), {"causal": True}, ()),
        ("documents", (1, 6, 6, 300, 300, 32), {"mask": M.document(torch.tensor([0] * 90 + [1] * 210))}, ()),
        ("alibi", (1, 6, 2, 300, 300, 32),
         {"causal": True, "score_mod": SM.alibi(attnkit.positional.alibi_slopes(6))}, ()),
        ("random eviction mask_mod (tile map)", (1, 6, 2, 300, 300, 32),
         {"mask": M.from_mod(fam["random_eviction"][0])}, ()),
        ("softcap score_mod (program)", (1, 6, 2, 300, 300, 32),
         {"causal": True, "score_mod": lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0)}, ()),
        ("learnable relative table (program + table gradient)", (1, 6, 2, 300, 300, 32),
         {"causal": True, "score_mod": lambda s, b, h, q, kv: s + table[h, kv - q + 300]}, (table,)),
    ]


def run(shape, kw, extra):
    B, H, Hkv, L, S, D = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, x, D, generator=g).requires_grad_() for n, x in ((H, L), (Hkv, S), (Hkv, S)))
    out, lse = attnkit.attention(q, k, v, return_lse=True, backend="tiled", **kw)
    go, gl = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    loss = (out * go).sum() + (lse.masked_fill(~torch.isfinite(lse), 0) * gl).sum()
    return [out, lse, *torch.autograd.grad(loss, (q, k, v, *extra))], attnkit.dispatch(q, k, v, backend="tiled",
                                                                                        **kw).worker


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--threads", default="2,4")
    a = ap.parse_args()
    print("| path | worker | threads | runs with the first run's bits |")
    print("|---|---|---|---|")
    for name, shape, kw, extra in paths():
        for t in (int(x) for x in a.threads.split(",")):
            torch.set_num_threads(t)
            first, worker = run(shape, kw, extra)
            same = 1
            for _ in range(a.repeats - 1):
                again, _ = run(shape, kw, extra)
                same += all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
            print(f"| {name} | {worker} | {t} | {same} / {a.repeats} |", flush=True)


if __name__ == "__main__":
    main()
