"""FlashMask's twelve mask families as users' ``mask_mod``s, against the same masks built in and SDPA.

    OMP_NUM_THREADS=2 python benchmarks/flashmask.py                    # L = 8192, fwd and fwd + bwd
    OMP_NUM_THREADS=2 python benchmarks/flashmask.py --length 4096 --rounds 3 --no-sdpa --json out.json

The families (``tests/_flashmask.py``: Full, Causal, Sliding Window, Causal Document, Document, Share
Question, Global Sliding Window, Causal Blockwise, Prefix-LM Document, Prefix-LM Causal, QK-sparse,
Random Eviction — FlashMask, ICLR 2025, appendix) are written as the FlexAttention ``mask_mod`` a user
writes, reading captured tensors where they need data. B = 1, H = 8, D = 64, fp32. Peers, interleaved
round by round (median of ``--rounds``):

* ``mod``      ``attnkit.attention(q, k, v, mask=masks.from_mod(fn))`` (``auto``; planning included: a
               mod reading a tensor is planned on every call);
* ``built-in`` the same mask as attnkit's own mask object, where one exists;
* ``before``   the mod with the compiled kernel switched off (``tiled.NATIVE = False``): torch's flash
               kernel once per run of keys, as attnkit ran users' mods before its kernel took tile maps;
* ``sdpa``     torch SDPA with the dense (1, H or 1, L, L) bool mask, built outside the timing.

Useful FLOPs: forward 4·D·(visible (query, key) pairs, summed over heads); forward + backward × 3.5.
``vs built-in`` is the time ratio mod / built-in (goal <= 1.1); ``of built-ins`` divides a family's useful
GFLOP/s by the mean useful GFLOP/s of the built-in peers in the same run (goal >= 0.7 for the families
with no built-in).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from _flashmask import NAMES, families

import attnkit
from attnkit import masks as M
from attnkit.backends import tiled

B, H, D = 1, 8, 64


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _run(q, k, v, mask, mode, native=True):
    saved = tiled.NATIVE
    tiled.NATIVE = native
    try:
        if mode == "fwd":
            with torch.no_grad():
                attnkit.attention(q, k, v, mask=mask)
        else:
            attnkit.attention(q, k, v, mask=mask).sum().backward()
    finally:
        tiled.NATIVE = saved


def _sdpa(q, k, v, dense, mode):
    if mode == "fwd":
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    else:
        F.scaled_dot_product_attention(q, k, v, attn_mask=dense).sum().backward()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--only", default="", help="comma-separated family names")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--no-before", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    L = a.length
    torch.manual_seed(0)
    fams = families(L, H=H, seed=0)
    names = [n for n in NAMES if not a.only or n in a.only.split(",")]
    print(f"# FlashMask families as mask_mods, L = S = {L}, B = {B}, H = {H}, D = {D}, fp32, "
          f"{torch.get_num_threads()} threads, median of {a.rounds}; times in ms")
    results = []
    for mode in a.modes.split(","):
        rows = []
        for name in names:
            mod, built = fams[name]
            mask = M.from_mod(mod)
            rg = mode != "fwd"
            q, k, v = (torch.randn(B, H, L, D, requires_grad=rg) for _ in range(3))
            dense = mask.materialize(B, H, L, L)
            dense = dense[:, :1] if bool((dense == dense[:, :1]).all()) else dense
            pairs = int(dense.expand(B, H, L, L).sum())
            worker = attnkit.dispatch(q, k, v, mask=mask).worker
            peers = {"mod": lambda m=mask: _run(q, k, v, m, mode)}
            if built is not None:
                peers["built-in"] = lambda m=built: _run(q, k, v, m, mode)
            if not a.no_before:
                peers["before"] = lambda m=mask: _run(q, k, v, m, mode, native=False)
            if not a.no_sdpa:
                peers["sdpa"] = lambda d=dense: _sdpa(q, k, v, d, mode)
            for p in peers.values():
                p()  # warm-up
            times: dict[str, list[float]] = {p: [] for p in peers}
            for _ in range(a.rounds):
                for p, fn in peers.items():
                    times[p].append(_timed(fn))
            med = {p: statistics.median(t) * 1e3 for p, t in times.items()}
            flops = 4 * D * pairs * (3.5 if mode != "fwd" else 1.0)
            rows.append({"family": name, "mode": mode, "worker": worker, "pairs": pairs, "ms": med,
                         "gflops_mod": flops / med["mod"] / 1e6,
                         "gflops_builtin": flops / med["built-in"] / 1e6 if "built-in" in med else None})
            del dense
        ref = [r["gflops_builtin"] for r in rows if r["gflops_builtin"]]
        mean_builtin = statistics.mean(ref) if ref else float("nan")
        print(f"\n## {mode}  (built-ins' mean useful GFLOP/s: {mean_builtin:.1f})")
        print("| family | worker | mod | built-in | before | sdpa | vs built-in | GFLOP/s | of built-ins |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            m = r["ms"]

            def f(p, m=m):
                return f"{m[p]:.1f}" if p in m else "—"

            vs = f"{m['mod'] / m['built-in']:.2f}×" if "built-in" in m else "—"
            print(f"| {r['family']} | {r['worker']} | {f('mod')} | {f('built-in')} | {f('before')} | {f('sdpa')} | "
                  f"{vs} | {r['gflops_mod']:.1f} | {r['gflops_mod'] / mean_builtin:.2f} |")
            r["of_builtins"] = r["gflops_mod"] / mean_builtin
        results += rows
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"length": L, "threads": torch.get_num_threads(), "rows": results}, fh, indent=1)


if __name__ == "__main__":
    main()
