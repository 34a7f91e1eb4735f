"""The 128k-token tile-mass map (issue 21): time, peak RSS and page size.

    OMP_NUM_THREADS=2 python benchmarks/tilemass.py                  # 131072 tokens, H=8, document + window
    OMP_NUM_THREADS=2 python benchmarks/tilemass.py --length 32768 --masks window

Each case runs in a fresh subprocess (its peak RSS is the child's own ``VmHWM``): it builds the
seeded synthetic q, k (D=64, float32) with ``attnkit.apps.long_inputs.synthetic``, computes
``attnkit.tile_mass`` (the timed part: "map s"), and writes the offline page ("page s",
"page MB"). Goals: map ≤ 10 s on 2 cores, peak RSS ≤ 1.5 GiB, page ≤ 5 MB.

Work: the score GEMMs are 2·H·D·(computed tiles)·bm·bn FLOP (reported as GFLOP/s over the map time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, torch
from attnkit.apps.long_inputs import synthetic
from attnkit.tilemass import tile_mass
from attnkit.bench.runner import peak_rss_kib
L, H, mask, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
q, k, m = synthetic(L, H=H, D=64, mask=mask)
t0 = time.perf_counter(); tm = tile_mass(q, k, mask=m); t_map = time.perf_counter() - t0
t0 = time.perf_counter(); page = tm.to_html(out); t_page = time.perf_counter() - t0
T = tm.tiles.shape[0]
print(json.dumps({"map_s": t_map, "page_s": t_page, "page_bytes": len(page.encode()), "tiles": T,
                  "tiles_total": tm.kinds.numel(), "gflop": 2 * H * 64 * T * 64 * 64 / 1e9,
                  "threads": torch.get_num_threads(), "peak_kib": peak_rss_kib()}))
"""


def run_case(L, H, mask):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "page.html")
        p = subprocess.run([sys.executable, "-c", CHILD, str(L), str(H), mask, out], capture_output=True, text=True,
                           check=True)
        res = json.loads(p.stdout.strip().splitlines()[-1])
        res["peak_rss_gib"] = res["peak_kib"] / 2 ** 20
        return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--masks", default="document,window")
    a = ap.parse_args()
    print(f"L={a.length}, H={a.heads}, D=64, float32, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'mask':<10} {'map s':>7} {'GFLOP/s':>8} {'peak RSS GiB':>13} {'page MB':>8} {'page s':>7}  tiles computed")
    for mask in a.masks.split(","):
        r = run_case(a.length, a.heads, mask)
        print(f"{mask:<10} {r['map_s']:>7.2f} {r['gflop'] / r['map_s']:>8.1f} {r['peak_rss_gib']:>13.2f} "
              f"{r['page_bytes'] / 1e6:>8.2f} {r['page_s']:>7.2f}  {r['tiles']} of {r['tiles_total']} "
              f"({100 * r['tiles'] / r['tiles_total']:.2f}%), threads {r['threads']}")


if __name__ == "__main__":
    main()
