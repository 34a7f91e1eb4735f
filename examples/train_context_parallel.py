"""Train the same tiny causal language model twice — in one process, and context-parallel over
W processes (gloo, CPU) — and print both loss curves side by side.

    torchrun --nproc-per-node 4 examples/train_context_parallel.py
    python examples/train_context_parallel.py --nproc 4            # spawns the 4 processes itself
    python examples/train_context_parallel.py --nproc 2 --steps 5 --layout zigzag

Each rank holds its rows of every sequence (``cp.shard``, dim 1 of the (B, L, E) activations,
under ``--layout``); attention runs through :func:`attnkit.distributed.block_forward` (the
module's own weights, RoPE at the layout's global positions, :class:`ContextParallel` attention);
every other layer is per token. Every rank starts from rank 0's weights (``akcp.sync_state``
broadcasts them, as DDP does). The loss is the mean over all tokens: each rank sums its tokens'
losses over the total count, and gradients are summed across ranks (as DDP would), so every rank
takes exactly the single-process step. Rank 0 also trains the single-process copy and checks:
first step's loss and gradients equal to <= 1e-5, curves within 1e-3 relative.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import attnkit.distributed as akd
from attnkit import masks
from attnkit.integrations import context_parallel as akcp
from attnkit.nn import TransformerBlock


class TinyLM(nn.Module):
    """Embedding → 2 pre-norm blocks (RoPE, GQA 4/2 heads, causal) → LayerNorm → vocabulary logits."""

    def __init__(self, vocab=32, E=32, H=4, Hkv=2, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, E)
        self.blocks = nn.ModuleList(TransformerBlock(E, H, num_kv_heads=Hkv, positional="rope", causal=True,
                                                     mlp_ratio=2) for _ in range(layers))
        self.norm = nn.LayerNorm(E)
        self.head = nn.Linear(E, vocab)

    def forward(self, tokens, cp=None):
        """tokens (B, L) → logits (B, L, vocab); with ``cp``: this rank's rows (B, L_r) → (B, L_r, vocab)."""
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x) if cp is None else akd.block_forward(blk, x, cp)
        return self.head(self.norm(x))


def batch(step, B, L, vocab):
    """Sequences of period L/4: after the first period the next token is the one L/4 - 1 positions
    back, so attention across shard boundaries matters (the loss drops from ln 32 toward 1/4 of it)."""
    g = torch.Generator().manual_seed(1000 + step)
    lag = L // 4
    x = torch.randint(0, vocab, (B, lag), generator=g).repeat(1, -(-(L + 1) // lag))[:, :L + 1]  # period lag
    return x[:, :-1], x[:, 1:]


def run(rank, world, port, args, report):
    torch.set_num_threads(1)
    if port is not None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model) if rank == 0 else None
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=args.lr) if ref is not None else None
    L = args.seq_len
    cp = akd.ContextParallel(L, mask=masks.causal(), layout=args.layout, block=args.block, timeout=60)
    # every rank takes rank 0's weights, as DDP does (the seed above already agrees; this makes sure)
    akcp.sync_state(model, cp)
    rows = cp.positions
    curve, first = [], {}
    t0 = time.time()
    for step in range(args.steps):
        x, y = batch(step, args.batch, L, 32)
        logits = model(x.index_select(1, rows), cp)  # (B, L_r, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), y.index_select(1, rows).flatten(), reduction="sum") / y.numel()
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()] + [loss.detach().view(1)])
        dist.all_reduce(flat)  # gradients (and the loss) summed over ranks: the mean over all tokens
        i = 0
        for p in model.parameters():
            p.grad.copy_(flat[i:i + p.numel()].view_as(p))
            i += p.numel()
        total = float(flat[-1])
        opt.step()
        if ref is not None:
            ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
            ref_opt.zero_grad()
            ref_loss.backward()
            if step == 0:
                first["loss"] = abs(total - ref_loss.item())
                first["grad"] = max((p.grad - r.grad).abs().max().item()
                                    for p, r in zip(model.parameters(), ref.parameters(), strict=True))
            ref_opt.step()
            curve.append((total, ref_loss.item()))
    from attnkit.bench.runner import peak_rss_kib  # this process's own peak (not the parent's at fork)

    rss = torch.tensor([peak_rss_kib() / 1024.0])  # MiB
    all_rss = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(all_rss, rss)
    if rank == 0:
        print("peak RSS per rank (MiB; rank 0 also trains the one-process copy): "
              + ", ".join(f"{float(x):.0f}" for x in all_rss))
        print(f"W={world} layout={args.layout} L={L} rows per rank={cp.layout.lengths} "
              f"last forward stats (rank 0): {cp.stats}")
        print(f"{'step':>5} {'context-parallel':>17} {'one process':>12} {'rel diff':>9}")
        worst = 0.0
        for s, (a, b) in enumerate(curve):
            rel = abs(a - b) / abs(b)
            worst = max(worst, rel)
            if s < 5 or s % 10 == 9 or s == len(curve) - 1:
                print(f"{s:>5} {a:>17.6f} {b:>12.6f} {rel:>9.2e}")
        ok = first["loss"] <= 1e-5 and first["grad"] <= 1e-5 and worst <= 1e-3
        print(f"first step: |loss diff| = {first['loss']:.2e}, max |grad diff| = {first['grad']:.2e}; "
              f"worst relative loss diff over {len(curve)} steps = {worst:.2e}; {time.time() - t0:.1f}s -> "
              f"{'OK' if ok else 'MISMATCH'}")
        if report is not None:
            report.put(ok)
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--nproc", type=int, default=4, help="processes to spawn when not started by torchrun")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layout", default="balanced", choices=["contiguous", "zigzag", "balanced"])
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args, None)
        return
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=run, args=(r, args.nproc, port, args, report if r == 0 else None))
             for r in range(args.nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    ok = report.get(timeout=5) if not report.empty() else False
    for r, p in enumerate(procs):  # a rank that died says how (a signal: its name), even after rank 0's verdict
        if p.exitcode != 0:
            how = signal.Signals(-p.exitcode).name if p.exitcode < 0 else f"exit status {p.exitcode}"
            print(f"rank {r} ended with {how}", file=sys.stderr)
    sys.exit(0 if ok and all(p.exitcode == 0 for p in procs) else 1)


if __name__ == "__main__":
    main()
