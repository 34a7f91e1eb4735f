"""Build time of attnkit's block plan (and its FlexAttention BlockMask) vs ``create_block_mask``.

    python benchmarks/plan_build.py [--lengths 16384,131072] [--block 128] [--mem-gib 12]

For each mask and length: ``attnkit.plan(mask, L, block=(b, b))`` (closed form for built-in
masks: no point of the mask is evaluated), ``plan.to_block_mask()``, and FlexAttention's
``create_block_mask(mask_mod, 1, 1, L, L, device="cpu", BLOCK_SIZE=b)`` (which evaluates the
mask at every (q, kv) point). Each ``create_block_mask`` runs in a subprocess under an
address-space limit (``--mem-gib``), so a length it cannot hold in memory is reported as such
instead of taking the machine down. Median of ``--repeats`` runs; the first call is reported
apart (it includes one-time setup).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

MASKS = {
    "causal": "masks.causal()",
    "window-4096": "masks.sliding_window(4096)",
    "document-16": "masks.document(torch.arange(L) // (L // 16))",
    "prefix-L/4": "masks.prefix_lm(L // 4)",
}

_FLEX = r'''
import resource, sys, time, json, statistics, torch
resource.setrlimit(resource.RLIMIT_AS, (int(float(sys.argv[4]) * 2**30),) * 2)
from attnkit import masks
from torch.nn.attention.flex_attention import create_block_mask
L, blk, reps = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
mask = eval(sys.argv[1])
mod = mask.flex_mask_mod(L, L)
ts = []
try:
    for _ in range(reps):
        t0 = time.perf_counter()
        create_block_mask(mod, 1, 1, L, L, device="cpu", BLOCK_SIZE=blk)
        ts.append(time.perf_counter() - t0)
    print(json.dumps({"first": ts[0], "median": statistics.median(ts[1:] or ts)}))
except (MemoryError, RuntimeError) as e:
    print(json.dumps({"error": type(e).__name__ + ": " + str(e).splitlines()[0][:120]}))
'''


def _ours(expr: str, L: int, blk: int, reps: int):
    import torch  # noqa: F401 - used by the mask expressions

    import attnkit
    from attnkit import masks  # noqa: F401

    plan_t, bm_t = [], []
    for _ in range(reps):
        mask = eval(expr)  # a new mask object each time: no cached tiles
        t0 = time.perf_counter()
        p = attnkit.plan(mask, L, block=(blk, blk))
        t1 = time.perf_counter()
        p.to_block_mask()
        t2 = time.perf_counter()
        plan_t.append(t1 - t0)
        bm_t.append(t2 - t1)
    return statistics.median(plan_t), statistics.median(bm_t), p.density


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,131072")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mem-gib", type=float, default=12.0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = []
    print("| mask | L | attnkit.plan | to_block_mask | plan + BlockMask | create_block_mask | speed-up | density |")
    print("|---|---|---|---|---|---|---|---|")
    for L in (int(x) for x in a.lengths.split(",")):
        for name, expr in MASKS.items():
            p, b, dens = _ours(expr, L, a.block, a.repeats)
            argv = [sys.executable, "-c", _FLEX, expr, str(L), str(a.block), str(a.mem_gib), str(a.repeats)]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
            try:
                flex = json.loads(r.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                flex = {"error": (r.stderr.strip().splitlines() or ["died"])[-1][:120]}
            ours = p + b
            if "median" in flex:
                fx, speed = f"{flex['median'] * 1e3:.1f} ms", f"{flex['median'] / ours:.0f}×"
            else:
                fx, speed = f"failed: {flex['error']}", "—"
            rows.append(dict(mask=name, L=L, plan_s=p, block_mask_s=b, flex=flex, density=dens))
            print(f"| {name} | {L} | {p * 1e3:.2f} ms | {b * 1e3:.2f} ms | {ours * 1e3:.2f} ms | {fx} | {speed} | "
                  f"{dens:.3f} |", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
