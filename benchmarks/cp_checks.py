"""What the ranks' agreement costs a context-parallel call: the backward's call check, timed against the call.

    python benchmarks/cp_checks.py [--L 4096] [--W 2] [--rounds 15]

Each of W gloo processes on 127.0.0.1 (one torch thread each) runs forward + backward of causal self-attention over
its shard (B = 1, H = Hkv = 4, D = 64, fp32, zigzag layout), alternating, round by round, a call whose backward first
checks that every rank backpropagates the same call (one message of 544 bytes to each peer and one from each: the
default) with one whose check is switched off. Printed: the median time of each and their ratio, and the median
time of the check alone (``cp._backward_check``, 200 times). Rank 0's times; every rank runs the same sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

_CHILD = r'''
import json, sys, time, statistics, torch
torch.set_num_threads(1)
import torch.distributed as dist
import attnkit.distributed as akd
from attnkit import masks
L, W, rounds, rank, port = (int(x) for x in sys.argv[1:6])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W)
cp = akd.ContextParallel(L, mask=masks.causal(), layout="zigzag", timeout=120)
g = torch.Generator().manual_seed(0)
q, k, v = (cp.shard(torch.randn(1, 4, L, 64, generator=g)).requires_grad_() for _ in range(3))
real = cp._backward_check
times = {"checked": [], "unchecked": []}
for r in range(rounds + 1):
    for name in ("checked", "unchecked") if r % 2 else ("unchecked", "checked"):
        cp._backward_check = real if name == "checked" else (lambda call: None)
        dist.barrier()
        t0 = time.perf_counter()
        cp.attention(q, k, v).sum().backward()
        dt = time.perf_counter() - t0
        if r:  # the first round warms up
            times[name].append(dt)
cp._backward_check = real
alone = []
for _ in range(200):
    t0 = time.perf_counter()
    real(cp._calls)
    alone.append(time.perf_counter() - t0)
if rank == 0:
    print(json.dumps({k: statistics.median(v) for k, v in times.items()} | {"alone": statistics.median(alone)}))
dist.destroy_process_group()
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=4096, help="global sequence length (default 4096)")
    ap.add_argument("--W", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--rounds", type=int, default=15, help="alternations (default 15)")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(a.L), str(a.W), str(a.rounds), str(r), str(port)],
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(a.W)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"a rank failed: return codes {[p.returncode for p in procs]}")
    res = json.loads(outs[0].strip().splitlines()[-1])
    print(f"L = {a.L}, W = {a.W}, causal, fwd + bwd, median of {a.rounds} alternations (rank 0):")
    print(f"  with the backward's call check    {1e3 * res['checked']:9.2f} ms")
    print(f"  without it                        {1e3 * res['unchecked']:9.2f} ms")
    print(f"  ratio                             {res['checked'] / res['unchecked']:9.3f}")
    print(f"  the check alone                   {1e6 * res['alone']:9.1f} µs")


if __name__ == "__main__":
    main()
