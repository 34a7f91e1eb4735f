"""Per-rank peak memory of context parallelism vs one process (measured, not argued).

    python benchmarks/context_parallel_rss.py [--L 131072] [--W 2,4,8] [--window 4096]
    python benchmarks/context_parallel_rss.py --L 32768 --W 2 --threads-one 2   # the time of splitting

``--threads-one`` sets the single process's torch threads (default 1): with 2, the one-process run
and the W = 2 run (one thread per rank) use the same two cores — the overhead of splitting.
The goal: per-rank peak RSS net of what torch itself takes (``import torch, attnkit``: measured here
in a fresh process, ~285 MiB) falls ≥ 1.7× per doubling of W.

Forward + backward of self-attention with a sliding window over one sequence of length L
(B = 1, H = Hkv = 2, D = 64, fp32): once in a single process (``attnkit.attention``, the
tiled backend), once split over W gloo processes on 127.0.0.1 (``attnkit.distributed``,
contiguous layout, plan-aware p2p). Each process reports its peak RSS (``VmHWM``: its own, not the parent's at fork) and
the time of the call; the table compares them. Every process starts fresh, so the peaks are
its own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys

_CHILD = r'''
import json, os, sys, time, torch
from attnkit.bench.runner import peak_rss_kib
import torch.distributed as dist
torch.set_num_threads(int(os.environ.get("CP_THREADS", "1")))
import attnkit, attnkit.distributed as akd
from attnkit import masks
L, W, window, rank = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
if W == 1:
    q, k, v = (torch.randn(1, 2, L, 64, requires_grad=True) for _ in range(3))
    base = peak_rss_kib()
    t0 = time.perf_counter()
    attnkit.attention(q, k, v, mask=masks.sliding_window(window)).sum().backward()
else:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[5], rank=rank, world_size=W)
    cp = akd.ContextParallel(seq_len=L, mask=masks.sliding_window(window), layout="contiguous")
    n = len(cp.positions)  # each rank holds only its own rows, as it would in a real model
    q, k, v = (torch.randn(1, 2, n, 64, requires_grad=True) for _ in range(3))
    base = peak_rss_kib()
    t0 = time.perf_counter()
    out = cp.attention(q, k, v)
    fwd_peak = peak_rss_kib()
    if os.environ.get("CP_FWD_ONLY") != "1":
        out.sum().backward()
    sent = cp.stats.bytes_sent
t = time.perf_counter() - t0
print(json.dumps({"rank": rank, "peak_mib": peak_rss_kib() / 1024,
                  "inputs_mib": base / 1024, "seconds": t,
                  "sent_mib": (sent / 2**20) if W > 1 else 0.0}), flush=True)
if W > 1:
    dist.destroy_process_group()
'''


_IMPORT = ("import json, torch, attnkit, attnkit.distributed; from attnkit.bench.runner import peak_rss_kib; "
           "print(json.dumps(peak_rss_kib() / 1024))")


def _run(L, W, window, port, threads=1):
    import os
    env = dict(os.environ, CP_THREADS=str(threads))
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(L), str(W), str(window), str(r), str(port)],
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(W)]
    return [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--L", type=int, default=131072)
    ap.add_argument("--W", default="2,4,8", help="world sizes, comma-separated")
    ap.add_argument("--threads-one", type=int, default=1, help="torch threads of the one-process run")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--port", type=int, default=29533)
    a = ap.parse_args(argv)
    torch_mib = json.loads(subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True,
                                          check=True).stdout)
    one = _run(a.L, 1, a.window, a.port, a.threads_one)[0]
    print(f"L={a.L}, window {a.window}, B=1, H=Hkv=2, D=64, fp32, fwd+bwd; one process: {a.threads_one} torch "
          f"thread(s); ranks: 1 each. `import torch, attnkit` alone: {torch_mib:.0f} MiB\n")
    print("| run | rank | peak RSS MiB | net of torch MiB | K/V sent MiB | seconds |")
    print("|---|---|---|---|---|---|")
    print(f"| one process | - | {one['peak_mib']:.0f} | {one['peak_mib'] - torch_mib:.0f} | - | {one['seconds']:.1f} |")
    nets = {}
    for W in (int(x) for x in a.W.split(",")):
        many = _run(a.L, W, a.window, a.port)
        for r in many:
            print(f"| W={W} | {r['rank']} | {r['peak_mib']:.0f} | {r['peak_mib'] - torch_mib:.0f} | "
                  f"{r['sent_mib']:.1f} | {r['seconds']:.1f} |")
        nets[W] = max(r["peak_mib"] for r in many) - torch_mib
        print(f"| W={W} | max | | **{nets[W]:.0f}** | | {max(r['seconds'] for r in many):.1f} |")
    Ws = sorted(nets)
    for w0, w1 in itertools.pairwise(Ws):
        print(f"\nbusiest rank, net of torch: W={w0} → W={w1}: {nets[w0] / nets[w1]:.2f}× less")
    for W in Ws:
        print(f"one process / W={W} busiest rank, net of torch: {(one['peak_mib'] - torch_mib) / nets[W]:.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
