"""One rank of the two-host context-parallel test (tests/distributed/test_cp_two_hosts.py), started by torchrun
inside a network namespace: a causal attention over 4 ranks on 2 "hosts", forward and backward,
checked against the float64 single-process reference; each rank prints one line and writes it to
``$AK_OUT_DIR/rank<r>.txt``."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

import attnkit
import attnkit.distributed as akd
from attnkit import masks


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, W = dist.get_rank(), dist.get_world_size()
    L, B, H, Hkv, D = 41, 2, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, Hkv, Hkv))
    go = torch.randn(B, H, L, D, generator=g)
    cp = akd.ContextParallel(L, mask=masks.causal(), layout="zigzag", block=2, timeout=60)
    ql, kl, vl = (cp.shard(t).requires_grad_() for t in (q, k, v))
    out = cp.attention(ql, kl, vl)
    (out * cp.shard(go)).sum().backward()
    q2, k2, v2 = (t.double().requires_grad_() for t in (q, k, v))
    ref = attnkit.attention(q2, k2, v2, causal=True, backend="eager")
    (ref * go.double()).sum().backward()
    err = (out.double() - cp.shard(ref.detach())).abs().max().item()
    gerr = max((a.grad.double() - cp.shard(b.grad)).abs().max().item() for a, b in ((ql, q2), (kl, k2), (vl, v2)))
    st = cp.stats
    line = (f"rank {rank}/{W} on {os.environ.get('AK_HOST_IP', '?')} (node {os.environ.get('GROUP_RANK', '?')}): "
            f"rows {len(cp.positions)}, out err {err:.2e}, grad err {gerr:.2e}, sent {st.bytes_sent} B to "
            f"{list(st.peers_sent)}, K/V held at most {cp.backward_stats.kv_held_max}")
    print(line, flush=True)
    # torchrun interleaves its children's stdout (two ranks' lines ran together once): the test reads files
    with open(os.path.join(os.environ["AK_OUT_DIR"], f"rank{rank}.txt"), "w") as f:
        f.write(line + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
